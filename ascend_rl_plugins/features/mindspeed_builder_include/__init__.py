"""MindSpeed op builder: ``-include cstring`` for openEuler 24.03 toolchains.

MindSpeed JIT-compiles its C++ ops through ``MindSpeedOpBuilder.load``, which passes
``self.cxx_args()`` to ``torch.utils.cpp_extension.load`` as ``extra_cflags``. With the
compiler of openEuler 24.03 that build fails on a missing header (the recipe's patch says so and
forces ``<cstring>`` into every translation unit). ``cxx_args`` is after-patched to end with
``-include cstring`` when it is not there yet, on the base builder (every subclass that
overrides ``cxx_args`` in MindSpeed 028de58 extends ``super().cxx_args()``) and on the one
subclass that builds its list from scratch, ``AdaptiveRecomputingPluggableAllocatorBuilder``.
The flag is appended as two arguments (``-include``, ``cstring``): right both in the ninja
file torch writes (``cflags`` joined with spaces) and as separate compiler arguments.
README.md beside this file: why, flags, verified where.

Remove when: MindSpeed's op sources include ``<cstring>`` themselves (or its builder adds the
flag; master 028de58 does not).
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_MINDSPEED_BUILDER_INCLUDE", "bool", True,
    "Add '-include cstring' to the compiler flags of MindSpeed's JIT-built C++ ops (needed by "
    "the openEuler 24.03 toolchain); added only when missing.", feature="mindspeed_builder_include")

FEATURE = Feature(
    "mindspeed_builder_include", "MindSpeed's C++ ops build with '-include cstring' (openEuler 24.03).",
    flag=ENABLE, replaces="the recipe's MindSpeed patch 0001-mindspeed-bugfix-builder",
    verified=Verified(doubles="MindSpeed op builder classes (tests/doubles/mindspeed_double): flags added "
                              "once, on the base class, on subclasses extending it and on the one that does not",
                      static="MindSpeed 028de58: targets and signatures; every cxx_args override either "
                             "extends super().cxx_args() or is patched itself"),
    stacks="MindSpeed (not installable here)")

INCLUDE = ("-include", "cstring")
MINDSPEED_RANGE = ">=0.12,<0.17"
REMOVE_WHEN = "MindSpeed's op sources include <cstring> themselves, or its builder adds the flag"


def has_include(args) -> bool:
    """``-include cstring`` present, as two arguments or as one ('-include cstring')."""
    items = [str(a).strip() for a in args]
    joined = " ".join(INCLUDE)
    return joined in items or any(a == INCLUDE[0] and b == INCLUDE[1] for a, b in zip(items, items[1:]))


def with_include(args):
    """``args`` (a list, as MindSpeed returns) with ``-include cstring`` appended when missing."""
    if has_include(args):
        return args
    return list(args) + list(INCLUDE)


def _append_include(result, instance, args, kwargs):
    return with_include(result)


FEATURE.after("mindspeed.op_builder.builder:MindSpeedOpBuilder.cxx_args", _append_include,
              name="mindspeed_builder_include.builder_cxx_args", dist="mindspeed", versions=MINDSPEED_RANGE,
              params=("self",),
              reason="MindSpeed's JIT-built C++ ops fail to compile with the openEuler 24.03 "
                     "toolchain for want of <cstring>; force-include it",
              replaces="recipe MindSpeed 0001 (edits MindSpeedOpBuilder.cxx_args)", remove_when=REMOVE_WHEN)
FEATURE.after("mindspeed.op_builder.adaptive_recomputing_builder:AdaptiveRecomputingPluggableAllocatorBuilder.cxx_args",
              _append_include, name="mindspeed_builder_include.adaptive_recomputing_cxx_args", dist="mindspeed",
              versions=MINDSPEED_RANGE, params=("self",),
              reason="this builder writes its compiler flags from scratch instead of extending "
                     "MindSpeedOpBuilder.cxx_args, so the base patch does not reach it",
              remove_when=REMOVE_WHEN)
