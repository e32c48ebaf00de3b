"""moe_reshard converter: ``ascend-rl moe-reshard convert`` HF -> Megatron-Core -> HF is
bit-identical on a tiny random bf16 checkpoint (experts in some layers only, non-expert tensors
passed through), for GroupedMLP (ETP 1 and 2, PP 2), SequentialMLP and TEGroupedMLP names; the
Megatron shards are exactly layout.hf_to_megatron's (the mapping the reshard uses at run time).
Real: safetensors, torch.save/load; nothing downloaded."""

from __future__ import annotations

import argparse
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from ascend_rl_plugins.features.moe_reshard import cli as moe_cli  # noqa: E402
from ascend_rl_plugins.features.moe_reshard.layout import PROJS, MoEShape, TrainingLayout, hf_expert_name, \
    hf_to_megatron  # noqa: E402

LAYERS, EXPERTS, HIDDEN, FFN = 4, 4, 8, 6
MOE_LAYERS = (1, 2, 3)   # layer 0 dense, as in models with first_k_dense_replace


def _checkpoint(directory) -> dict:
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(7)
    tensors = {"model.embed_tokens.weight": torch.randn(16, HIDDEN, generator=g).bfloat16(),
               "model.layers.0.mlp.gate_proj.weight": torch.randn(FFN, HIDDEN, generator=g).bfloat16()}
    for layer in MOE_LAYERS:
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(EXPERTS, HIDDEN, generator=g).bfloat16()
        for e in range(EXPERTS):
            for p in PROJS:
                size = (HIDDEN, FFN) if p == "down_proj" else (FFN, HIDDEN)
                tensors[hf_expert_name(layer, e, p)] = torch.randn(size, generator=g).bfloat16()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[: len(names) // 2]}, os.path.join(directory, "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[len(names) // 2:]}, os.path.join(directory, "model-00002-of-00002.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"num_hidden_layers": LAYERS}, f)
    return tensors


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ascend-rl")
    moe_cli.register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _read_all(directory) -> dict:
    from safetensors import safe_open
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.parametrize("impl,pp,ep,etp,pp_layers", [
    ("grouped", 1, 2, 1, None), ("grouped", 1, 2, 2, None), ("grouped", 2, 4, 1, None), ("grouped", 2, 2, 1, "3,1"),
    ("sequential", 1, 2, 2, None), ("te_grouped", 1, 1, 1, None)])
def test_hf_to_mcore_to_hf_is_bit_identical(tmp_path, impl, pp, ep, etp, pp_layers):
    hf_dir, mc_dir, back = tmp_path / "hf", tmp_path / "mcore", tmp_path / "back"
    hf_dir.mkdir()
    original = _checkpoint(hf_dir)
    assert _run(["moe-reshard", "convert", "--direction", "hf-to-mcore", "--expert-impl", impl, "-i", str(hf_dir),
                 "-o", str(mc_dir), "--pp", str(pp), "--ep", str(ep), "--etp", str(etp)]
                + (["--pp-layers", pp_layers] if pp_layers else [])) == 0
    meta = json.loads((mc_dir / "moe_layout.json").read_text())
    assert len(meta["files"]) == pp * ep * etp
    # the shards are exactly the run-time mapping's
    shape = MoEShape(LAYERS, EXPERTS, HIDDEN, FFN, moe_layers=MOE_LAYERS)
    stages = tuple(s for s, n in enumerate(map(int, pp_layers.split(","))) for _ in range(n)) if pp_layers else None
    training = TrainingLayout(tp=1, pp=pp, ep=ep, etp=etp, expert_impl=impl,
                              layer_stages=stages).with_world(pp * ep * etp)
    for (stage, ep_rank, etp_rank), ranks in training.owner_table(shape).items():
        saved = torch.load(mc_dir / f"experts_pp{stage}_ep{ep_rank}_etp{etp_rank}.pt", weights_only=True)
        want = hf_to_megatron(original, shape, training, ranks[0])
        assert sorted(saved) == sorted(want)
        assert all(torch.equal(saved[k], want[k]) and saved[k].dtype == torch.bfloat16 for k in want)
        if impl == "grouped":
            assert all(k.endswith(("weight1", "weight2")) for k in saved)
    assert _run(["moe-reshard", "convert", "--direction", "mcore-to-hf", "-i", str(mc_dir), "-o", str(back)]) == 0
    restored = _read_all(back)
    assert sorted(restored) == sorted(original)
    for k, t in original.items():
        assert restored[k].dtype == t.dtype and torch.equal(restored[k], t), k
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)


def test_convert_reports_bad_inputs(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    _checkpoint(hf_dir)
    assert _run(["moe-reshard", "convert", "--direction", "hf-to-mcore", "-i", str(hf_dir), "-o",
                 str(tmp_path / "x"), "--ep", "3"]) == 2
    assert "not divisible by training ep 3" in capsys.readouterr().err
    assert _run(["moe-reshard", "convert", "--direction", "mcore-to-hf", "-i", str(tmp_path / "nothing"), "-o",
                 str(tmp_path / "y")]) == 2
    assert "moe_layout.json" in capsys.readouterr().err


def test_plan_command_prints_the_minimum(capsys):
    assert _run(["moe-reshard", "plan", "--layers", "4", "--experts", "8", "--hidden", "16", "--ffn", "8",
                 "--ep", "2", "--tp", "2", "--rollout-dp", "4", "--bucket-mb", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "world 4" in out and "minimum" in out
    assert _run(["moe-reshard", "plan", "--layers", "4", "--experts", "6", "--hidden", "16", "--ffn", "8",
                 "--ep", "4", "--rollout-dp", "4"]) == 2
    assert "cannot plan" in capsys.readouterr().err


def test_the_feature_exposes_the_cli():
    """ascend-rl discovers feature CLIs through the package's register_cli."""
    import ascend_rl_plugins.features.moe_reshard as feature
    assert getattr(feature, "register_cli", None) is moe_cli.register_cli, \
        "ascend_rl_plugins.features.moe_reshard must export register_cli (ascend-rl moe-reshard ...)"
