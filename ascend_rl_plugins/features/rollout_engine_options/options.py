"""The engine options of verl 0.6's SPMD vLLM rollout: checked, merged, made effective.

Everything here reads the rollout section of verl's config (``actor_rollout_ref.rollout``: a
``RolloutConfig`` dataclass, an OmegaConf node or a dict) and returns plain values; vLLM is
imported only to learn the names it accepts (``accepted_*``), and only when asked.

Where the options come from: ``actor_rollout_ref.rollout.engine_kwargs.vllm``, which verl 0.6.1
already passes to ``vllm.LLM(**...)`` unchanged, so ``speculative_config``,
``compilation_config`` and ``additional_config`` reach the engine without help. What goes wrong
without this module:

* speculative decoding drafts nothing: verl builds its ``SamplingParams`` with ``logprobs=0``,
  and vLLM (``v1/spec_decode/utils.py: is_spec_decode_unsupported``) excludes every request
  that asks for logprobs from drafting;
* ``rollout.cudagraph_capture_sizes`` is dropped: verl checks ``isinstance(sizes, ListConfig)``
  but its config dataclass holds a plain list, so it only logs "must be a list";
* npugraph_ex is switched off silently by vLLM-Ascend unless the engine runs a FULL or
  FULL_DECODE_ONLY graph (``vllm_ascend/platform.py``), and its switch lives under a different
  key in each vLLM-Ascend release;
* a typo in any of these surfaces deep inside engine start-up on every worker, long after the
  job was scheduled.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable, Mapping

ROLLOUT = "actor_rollout_ref.rollout"
ENGINE_KWARGS = f"{ROLLOUT}.engine_kwargs.vllm"
GRAPH_MODES_FOR_NPUGRAPH_EX = ("FULL", "FULL_DECODE_ONLY")
DEFAULT_NPUGRAPH_EX_MODE = "FULL"  # what the recipe's patch used


class EngineOptionsError(ValueError):
    """A rollout engine option is not acceptable (raised at config time)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What the process asked for through ascend-rl flags (not through verl's config)."""

    npugraph_ex: bool = False
    static_kernel: bool = False
    sam: bool = True  # the sam feature is on: method "sam" is accepted


@dataclasses.dataclass
class Plan:
    """The engine options to build the rollout with."""

    engine_kwargs: dict  # the new actor_rollout_ref.rollout.engine_kwargs.vllm
    capture_sizes_merged: bool  # rollout.cudagraph_capture_sizes moved into compilation_config
    speculative: bool  # speculative decoding configured: requests must not ask for logprobs


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    getter = getattr(cfg, "get", None)
    if getter is not None:
        return getter(key, default)
    return getattr(cfg, key, default)


def plain(value: Any) -> Any:
    """OmegaConf containers -> dict/list (a deep copy either way)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        pass
    return copy.deepcopy(value)


def _is_mapping(value: Any) -> bool:
    return isinstance(value, Mapping)


def _positive_ints(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value))


def _literal_values(tp) -> list[str]:
    import typing
    out: list[str] = []
    for arg in typing.get_args(tp):
        if isinstance(arg, str):
            out.append(arg)
        else:
            out.extend(_literal_values(arg))
    return out


def accepted_methods(sam: bool) -> list[str] | None:
    """Speculative methods the installed vLLM accepts (its ``SpeculativeMethod`` literal),
    plus ``sam`` when the sam feature is on; None when vLLM cannot tell."""
    try:
        from vllm.config import speculative
        names = _literal_values(speculative.SpeculativeMethod)
    except Exception:  # vLLM absent or reorganised: let vLLM validate at engine build
        return None
    return sorted(set(names) | ({"sam"} if sam else set()))


def accepted_graph_modes() -> list[str] | None:
    """``compilation_config.cudagraph_mode`` names of the installed vLLM."""
    try:
        from vllm.config.compilation import CUDAGraphMode
    except Exception:
        return None
    return [m.name for m in CUDAGraphMode]


def npugraph_ex_switch(vllm_version: str | None, static_kernel: bool) -> dict:
    """``additional_config`` entries that switch vLLM-Ascend's npugraph_ex backend on.

    vLLM-Ascend 0.13 reads ``additional_config["enable_npugraph_ex"]`` and always compiles
    static-shape kernels; later releases (0.23) read
    ``additional_config["ascend_compilation_config"]`` (``enable_npugraph_ex``,
    ``enable_static_kernel``). vLLM-Ascend releases follow vLLM's version numbers."""
    from packaging.version import Version
    release = Version(vllm_version).release if vllm_version else (0, 13)
    if release[:2] <= (0, 13):
        return {"enable_npugraph_ex": True}
    return {"ascend_compilation_config": {"enable_npugraph_ex": True, "enable_static_kernel": static_kernel}}


def _npugraph_ex_in(additional: Mapping) -> bool:
    nested = additional.get("ascend_compilation_config")
    return bool(additional.get("enable_npugraph_ex")) or (
        _is_mapping(nested) and bool(nested.get("enable_npugraph_ex", False)))


def _merge(into: dict, extra: Mapping) -> dict:
    """``extra`` merged into ``into`` recursively, existing (user) values winning."""
    for key, value in extra.items():
        if _is_mapping(value) and _is_mapping(into.get(key)):
            _merge(into[key], value)
        else:
            into.setdefault(key, copy.deepcopy(value))
    return into


def _check_speculative(spec: Any, methods: Iterable[str] | None, calculate_log_probs: bool, sam: bool) -> None:
    key = f"{ENGINE_KWARGS}.speculative_config"
    if not _is_mapping(spec):
        raise EngineOptionsError(f"{key} must be a mapping such as {{method: sam, num_speculative_tokens: 3}}; "
                                 f"got {spec!r}")
    method = spec.get("method")
    if method is None and spec.get("model") is None:
        raise EngineOptionsError(f"{key} needs a method (one of {', '.join(methods or ['...'])}) or a draft "
                                 f"model")
    if method is not None and methods is not None and method not in methods:
        hint = "" if sam or method != "sam" else " (method 'sam' needs the ascend-rl sam feature: ASCEND_RL_SAM=1)"
        raise EngineOptionsError(f"{key}.method={method!r} is not accepted{hint}; accepted: {', '.join(methods)}")
    tokens = spec.get("num_speculative_tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
        raise EngineOptionsError(f"{key}.num_speculative_tokens={tokens!r} is not valid; accepted: an integer >= 1")
    if calculate_log_probs:
        raise EngineOptionsError(
            f"{key} is set together with {ROLLOUT}.calculate_log_probs=True: vLLM does not draft for "
            f"requests that ask for logprobs, so nothing would be speculated; set "
            f"{ROLLOUT}.calculate_log_probs=False or remove {key}")


def _check_compilation(comp: Any, modes: Iterable[str] | None) -> None:
    key = f"{ENGINE_KWARGS}.compilation_config"
    if not _is_mapping(comp):
        raise EngineOptionsError(f"{key} must be a mapping of vLLM CompilationConfig fields (e.g. "
                                 f"{{cudagraph_mode: FULL_DECODE_ONLY}}); got {comp!r}")
    mode = comp.get("cudagraph_mode")
    if mode is not None and (not isinstance(mode, str) or (modes is not None and mode.upper() not in modes)):
        raise EngineOptionsError(f"{key}.cudagraph_mode={mode!r} is not valid; accepted: "
                                 f"{', '.join(modes or ['a CUDAGraphMode name'])}")
    sizes = comp.get("cudagraph_capture_sizes")
    if sizes is not None and not _positive_ints(sizes):
        raise EngineOptionsError(f"{key}.cudagraph_capture_sizes={sizes!r} is not valid; accepted: a non-empty "
                                 f"list of positive integers")


def plan(rollout: Any, request: Request, *, vllm_version: str | None = None,
         methods: Iterable[str] | None = None, graph_modes: Iterable[str] | None = None) -> Plan:
    """Check the rollout's engine options and compute the ones to build the engine with.

    Raises :class:`EngineOptionsError` naming the config key and what is accepted."""
    raw = _get(_get(rollout, "engine_kwargs", {}) or {}, "vllm", {})
    engine = plain(raw) if raw is not None else {}
    if not _is_mapping(engine):
        raise EngineOptionsError(f"{ENGINE_KWARGS} must be a mapping of vllm.LLM keyword arguments; got {raw!r}")
    engine = {k: v for k, v in engine.items() if v is not None}  # None = vLLM's default, as verl does
    enforce_eager = bool(_get(rollout, "enforce_eager", True))

    spec = engine.get("speculative_config")
    if spec is not None:
        _check_speculative(spec, methods, bool(_get(rollout, "calculate_log_probs", False)), request.sam)

    if "compilation_config" in engine:
        _check_compilation(engine["compilation_config"], graph_modes)
    sizes = plain(_get(rollout, "cudagraph_capture_sizes"))
    merged = False
    if sizes is not None and not enforce_eager:
        if not _positive_ints(sizes):
            raise EngineOptionsError(f"{ROLLOUT}.cudagraph_capture_sizes={sizes!r} is not valid; accepted: a "
                                     f"non-empty list of positive integers")
        comp = engine.setdefault("compilation_config", {})
        theirs = comp.get("cudagraph_capture_sizes")
        if theirs is not None and list(theirs) != list(sizes):
            raise EngineOptionsError(f"{ROLLOUT}.cudagraph_capture_sizes={sizes} and "
                                     f"{ENGINE_KWARGS}.compilation_config.cudagraph_capture_sizes={theirs} "
                                     f"differ; set one of them")
        comp["cudagraph_capture_sizes"] = list(sizes)
        merged = True

    additional = engine.get("additional_config")
    if additional is not None and not _is_mapping(additional):
        raise EngineOptionsError(f"{ENGINE_KWARGS}.additional_config must be a mapping; got {additional!r}")
    if request.static_kernel and not request.npugraph_ex:
        raise EngineOptionsError(
            "ASCEND_RL_ROLLOUT_ENGINE_OPTIONS_NPUGRAPH_EX_STATIC_KERNEL (alias NPUGRAPH_EX_ENABLE_STATIC_KERNEL) "
            "needs npugraph_ex: set ASCEND_RL_ROLLOUT_ENGINE_OPTIONS_NPUGRAPH_EX=1")
    if request.npugraph_ex:
        additional = _merge(dict(additional or {}), npugraph_ex_switch(vllm_version, request.static_kernel))
        if not _npugraph_ex_in(additional):
            raise EngineOptionsError(
                f"ASCEND_RL_ROLLOUT_ENGINE_OPTIONS_NPUGRAPH_EX=1 but {ENGINE_KWARGS}.additional_config switches "
                f"npugraph_ex off; remove one of the two")
        engine["additional_config"] = additional
    if additional and _npugraph_ex_in(additional):
        if enforce_eager:
            raise EngineOptionsError(f"npugraph_ex is a graph mode but {ROLLOUT}.enforce_eager=True; set "
                                     f"{ROLLOUT}.enforce_eager=False")
        comp = engine.setdefault("compilation_config", {})
        if not _is_mapping(comp):
            raise EngineOptionsError(f"npugraph_ex needs {ENGINE_KWARGS}.compilation_config to be a mapping "
                                     f"with cudagraph_mode FULL or FULL_DECODE_ONLY; got {comp!r}")
        mode = comp.setdefault("cudagraph_mode", DEFAULT_NPUGRAPH_EX_MODE)
        if str(mode).upper() not in GRAPH_MODES_FOR_NPUGRAPH_EX:
            raise EngineOptionsError(
                f"{ENGINE_KWARGS}.compilation_config.cudagraph_mode={mode!r}: vLLM-Ascend switches npugraph_ex "
                f"off unless the graph mode is one of {', '.join(GRAPH_MODES_FOR_NPUGRAPH_EX)}")
    return Plan(engine, merged, spec is not None)


def with_engine_options(rollout: Any, new: Plan) -> Any:
    """A copy of the rollout config carrying ``new.engine_kwargs`` (and no separate capture
    sizes when they were merged into ``compilation_config``). The caller's object is not
    changed."""
    engine_kwargs = plain(_get(rollout, "engine_kwargs", {}) or {})
    engine_kwargs["vllm"] = new.engine_kwargs
    changes: dict[str, Any] = {"engine_kwargs": engine_kwargs}
    if new.capture_sizes_merged:
        changes["cudagraph_capture_sizes"] = None
    if dataclasses.is_dataclass(rollout) and not isinstance(rollout, type):
        return dataclasses.replace(rollout, **changes)
    try:
        from omegaconf import DictConfig, OmegaConf
        if isinstance(rollout, DictConfig):
            out = copy.deepcopy(rollout)
            with _open_dict(out):
                for key, value in changes.items():
                    OmegaConf.update(out, key, value, merge=False, force_add=True)
            return out
    except ImportError:  # pragma: no cover
        pass
    return {**dict(rollout), **changes}


def _open_dict(cfg):
    from omegaconf import open_dict
    return open_dict(cfg)
