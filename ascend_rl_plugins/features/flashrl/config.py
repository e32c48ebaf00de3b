"""FlashRL configs: the YAML file written by ``ascend-rl flashrl setup`` and its selection.

The file keeps FlashRL's layout (``{"configs": [{fn, model, profile, ...}, ...]}``) so
existing FlashRL configs are read unchanged. Several configs alternate across data
parallel ranks: rank ``r`` uses config ``r mod n``. Everything is validated when the
engine starts; a missing model or profile is an error naming the file and the fix.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

FNS = ("int8", "int8_fast", "int8_wo_prune", "int8_prune", "bf16", "fp8", "fp8_vllm", "fp8_fast",
       "fp8_vllm_fast", "fp8_channel", "fp8_tensor", "w4a16", "fp8_block")
INT8_FNS = ("int8", "int8_fast", "int8_wo_prune", "int8_prune")
FP8_FNS = ("fp8_channel", "fp8_tensor")  # compressed-tensors FP8 W8A8 checkpoints (per-channel / per-tensor)
# FlashRL's profile-free FP8 (vLLM's own online `quantization="fp8"` on the BF16 model)
VLLM_FP8_FNS = ("fp8", "fp8_vllm", "fp8_fast", "fp8_vllm_fast")
INT4_FNS = ("w4a16",)  # compressed-tensors W4A16 pack-quantized checkpoints (group-wise, symmetric)
BLOCK_FP8_FNS = ("fp8_block",)  # 128x128 block FP8 (slime's FP8 rollout): vLLM 0.23 CPU with AMX only, see fp8_support
PRESETS = ("bf16", "int8", "fp8")
SUPPORTED_FNS = INT8_FNS + FP8_FNS + INT4_FNS + BLOCK_FP8_FNS + ("bf16",)
FN_NEEDS_MODEL = INT8_FNS + FP8_FNS + INT4_FNS + BLOCK_FP8_FNS
FP8_HOWTO = ("write an FP8 W8A8 checkpoint with `ascend-rl flashrl quantize -m BF16 -o FP8 --fn fp8_channel` "
             "(optionally -p PROFILE), then `ascend-rl flashrl setup -m FP8 [-p PROFILE] --fn fp8_channel -o CONFIG` "
             "and set ASCEND_RL_FLASHRL=CONFIG")


class ConfigError(ValueError):
    """A FlashRL config, preset or path is not usable."""


@dataclass
class RolloutConfig:
    """One entry of the config file (FlashRL's keys; unknown keys are kept)."""

    fn: str = "int8"
    model: str | None = None  # local W8A8 checkpoint directory served by the engine
    profile: str | None = None  # ascend-rl profile file (smoothing factors)
    load_format: str = "auto"
    distributed_executor_backend: str = "external_launcher"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_int8(self) -> bool:
        return self.fn in INT8_FNS

    @property
    def is_fp8(self) -> bool:
        return self.fn in FP8_FNS

    @property
    def is_int4(self) -> bool:
        return self.fn in INT4_FNS

    @property
    def is_block_fp8(self) -> bool:
        return self.fn in BLOCK_FP8_FNS

    @property
    def is_quantized(self) -> bool:
        """Serves a quantized checkpoint whose updates are quantized online by this project."""
        return self.fn in INT8_FNS or self.fn in FP8_FNS or self.fn in INT4_FNS or self.fn in BLOCK_FP8_FNS

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        d = {k: v for k, v in d.items() if v is not None}
        d.update(extra)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> "RolloutConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: each entry of 'configs' must be a mapping, got {type(d).__name__}")
        known = {k: d[k] for k in ("fn", "model", "profile", "load_format", "distributed_executor_backend") if k in d}
        extra = {k: v for k, v in d.items() if k not in known}
        cfg = cls(**known, extra=extra)
        cfg.validate(where)
        return cfg

    def validate(self, where: str, check_files: bool = True) -> None:
        if self.fn not in FNS:
            raise ConfigError(f"{where}: fn={self.fn!r} is not a FlashRL quantization function; accepted: "
                              f"{', '.join(FNS)}")
        if self.fn not in SUPPORTED_FNS:
            raise ConfigError(f"{where}: fn={self.fn!r} is FlashRL's profile-free FP8 (vLLM's online "
                              f"quantization='fp8' of the BF16 model), which ascend-rl does not provide; for FP8 "
                              f"rollout {FP8_HOWTO}. Supported fn values: {', '.join(SUPPORTED_FNS)}")
        if self.fn in FN_NEEDS_MODEL and not self.model:
            what = {**{f: "FP8" for f in FP8_FNS}, "w4a16": "W4A16", "fp8_block": "block-FP8"}.get(self.fn, "W8A8")
            raise ConfigError(f"{where}: fn={self.fn!r} needs 'model' (the local {what} checkpoint directory)")
        if self.fn in INT4_FNS + BLOCK_FP8_FNS and self.profile:
            raise ConfigError(f"{where}: fn={self.fn!r} takes no profile (smoothing factors are for W8A8; "
                              f"W4A16 and block FP8 keep activations in 16 bits); remove 'profile'")
        if not check_files:
            return
        if self.model:
            require_local_dir(self.model, f"{where}: model")
        if self.profile:
            from .profile import Profile
            Profile.load(require_local_file(self.profile, f"{where}: profile"))


def looks_like_hub_id(path: str) -> bool:
    return not os.path.isabs(path) and not path.startswith(".") and path.count("/") >= 1 and not os.path.exists(path)


def require_local_dir(path: str, what: str) -> str:
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{what} {path!r} is a directory without config.json; it must be a local HF "
                              f"checkpoint directory")
        return path
    hint = (" It looks like a hub id: ascend-rl never downloads; download it yourself and pass the local "
            "directory." if looks_like_hub_id(path) else "")
    raise ConfigError(f"{what} {path!r} is not a local directory.{hint}")


def require_local_file(path: str, what: str) -> str:
    if os.path.isfile(path):
        return path
    hint = (" It looks like a hub path: ascend-rl never downloads; fetch the file yourself and pass a local "
            "path." if looks_like_hub_id(path) else "")
    raise ConfigError(f"{what} {path!r} does not exist.{hint}")


def load_configs(value: str) -> list[RolloutConfig]:
    """The configs for ``ASCEND_RL_FLASHRL=<value>`` (a preset name or a config path)."""
    text = value.strip()
    if text.lower() in PRESETS:
        if text.lower() == "fp8":
            from .fp8_support import fp8_support
            ok, why = fp8_support("channel")
            here = (f"this platform can serve FP8 W8A8 ({why})" if ok else
                    f"this platform cannot serve FP8 W8A8 ({why}); supported here: int8 config files and bf16")
            raise ConfigError(f"ASCEND_RL_FLASHRL=fp8: FP8 rollout needs an FP8 W8A8 checkpoint (FlashRL's "
                              f"profile-free preset, vLLM's online quantization='fp8', is not provided): "
                              f"{FP8_HOWTO}. {here[0].upper() + here[1:]}")
        if text.lower() == "int8":
            raise ConfigError("ASCEND_RL_FLASHRL=int8 needs a W8A8 checkpoint: write a config with "
                              "`ascend-rl flashrl setup -m INT8_DIR -p PROFILE --fn int8 -o CONFIG` and set "
                              "ASCEND_RL_FLASHRL=CONFIG")
        return [RolloutConfig(fn="bf16", load_format="dummy")]
    path = require_local_file(text, "ASCEND_RL_FLASHRL config")
    import yaml
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        raise ConfigError(f"ASCEND_RL_FLASHRL config {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("configs"), list) or not data["configs"]:
        raise ConfigError(f"ASCEND_RL_FLASHRL config {path!r} must be a mapping with a non-empty 'configs' list "
                          f"(write it with `ascend-rl flashrl setup`)")
    return [RolloutConfig.from_dict(d, f"{path} configs[{i}]") for i, d in enumerate(data["configs"])]


def dp_rank(model_parallel_size: int = 1, env=None) -> int:
    """This rollout worker's data-parallel rank: ``RANK // (tp * pp)`` (0 if unset)."""
    env = os.environ if env is None else env
    raw = env.get("RANK", "0")
    try:
        rank = int(raw)
    except ValueError:
        raise ConfigError(f"RANK={raw!r} is not an integer") from None
    return rank // max(1, model_parallel_size)


def select(configs: list[RolloutConfig], rank: int) -> tuple[int, RolloutConfig]:
    """Rank ``r`` uses config ``r mod n``."""
    index = rank % len(configs)
    return index, configs[index]


def write_config(path: str, entry: RolloutConfig, append: bool) -> list[dict]:
    import yaml
    configs: list[dict] = []
    if append and os.path.exists(path):
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
        configs = list(data.get("configs", []))
    configs.append(entry.as_dict())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        yaml.safe_dump({"configs": configs}, fh, sort_keys=True)
    return configs
