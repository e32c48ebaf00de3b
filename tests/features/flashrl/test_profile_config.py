"""Profile round trip, offline checkpoint, configs and the FlashRL-compatible CLI (no engine)."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from ascend_rl_plugins.features.flashrl import checkpoint, config, profile  # noqa: E402

from . import engine_scenario  # noqa: E402


@pytest.fixture(scope="module")
def pair(tiny_model_path, tmp_path_factory):
    """BF16 tiny Qwen3 + its W8A8 made with known smoothing; an updated BF16 copy."""
    wd = tmp_path_factory.mktemp("flashrl_pair")
    paths = engine_scenario.build_artifacts(str(wd))
    a = profile.read_tensors(paths["bf16_a"])
    return paths, engine_scenario.known_factors(a), a


def test_checkpoint_layout_is_compressed_tensors_w8a8(pair):
    paths, _, a = pair
    q = profile.read_tensors(paths["int8_a"])
    with open(os.path.join(paths["int8_a"], "config.json")) as fh:
        qc = json.load(fh)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    grp = qc["config_groups"]["group_0"]
    assert grp["weights"]["strategy"] == "channel" and grp["weights"]["symmetric"] and grp["weights"]["num_bits"] == 8
    assert grp["input_activations"]["dynamic"] and grp["input_activations"]["strategy"] == "token"
    assert qc["ignore"] == ["lm_head"]
    lin = checkpoint.linear_shapes(a)
    assert len(lin) == 14
    for name, shape in lin.items():
        assert q[name].dtype == torch.int8 and tuple(q[name].shape) == shape
        assert q[name[:-7] + ".weight_scale"].dtype == torch.float32
        assert tuple(q[name[:-7] + ".weight_scale"].shape) == (shape[0], 1)
    assert q["lm_head.weight"].dtype == torch.bfloat16 and torch.equal(q["lm_head.weight"], a["lm_head.weight"])
    assert os.path.exists(os.path.join(paths["int8_a"], "tokenizer.json"))


def test_profile_recovers_known_smoothing_factors_exactly(pair):
    paths, known, _ = pair
    p = profile.Profile.load(paths["profile"])
    assert p.scheme == "dynamic" and p.exact_fraction == 1.0 and len(p.linears) == 14
    for norm, s in known["norm"].items():
        assert torch.equal(p.col_smooth[norm], s), norm
        for consumer in profile.consumers_of(norm):
            assert torch.equal(p.col_smooth[consumer], s)
    for down, s in known["down"].items():
        assert torch.equal(p.col_smooth[down], s)
        assert torch.equal(p.row_gain[profile.gain_source(down)], 1.0 / s)


@pytest.mark.parametrize("fn", ["int8", "int8_prune"])
def test_online_quantization_with_profile_matches_offline_quantizer(pair, fn, tmp_path):
    paths, known, a = pair
    derived = profile.Profile.load(paths["profile"])
    updated = profile.read_tensors(paths["bf16_b"])
    online = dict(profile.OnlineQuantizer(derived, fn=fn).transform(updated.items()))
    known_prof = profile.Profile.from_factors(checkpoint.linear_shapes(a), known["norm"], known["down"])
    out = checkpoint.quantize_checkpoint(paths["bf16_b"], str(tmp_path / "w8a8"), profile=known_prof, fn=fn)
    offline = profile.read_tensors(out)
    assert set(online) == set(offline)
    for k in offline:
        assert online[k].dtype == offline[k].dtype and torch.equal(online[k], offline[k]), k


def test_int8_prune_zeroes_norm_channels_no_consumer_uses():
    lin = {"model.layers.0.self_attn.q_proj.weight": (4, 3), "model.layers.0.self_attn.k_proj.weight": (2, 3),
           "model.layers.0.self_attn.v_proj.weight": (2, 3)}
    tensors = [("model.layers.0.input_layernorm.weight", torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))]
    for name, shape in lin.items():
        w = torch.randn(shape).to(torch.bfloat16)
        w[:, 1] = 0  # channel 1 is dead in every consumer
        tensors.append((name, w))
    prof = profile.Profile(linears=sorted(lin))
    out = dict(profile.OnlineQuantizer(prof, fn="int8_prune").transform(tensors))
    assert out["model.layers.0.input_layernorm.weight"].tolist() == [1.0, 0.0, 3.0]
    out = dict(profile.OnlineQuantizer(prof, fn="int8").transform(tensors))
    assert out["model.layers.0.input_layernorm.weight"].tolist() == [1.0, 2.0, 3.0]


def test_profile_file_errors(tmp_path, pair):
    with pytest.raises(profile.ProfileError, match="does not exist"):
        profile.Profile.load(str(tmp_path / "nope.pt"))
    bad = tmp_path / "pickle.pt"
    torch.save({"x": 1}, bad)
    with pytest.raises(profile.ProfileError, match="not an ascend-rl profile"):
        profile.Profile.load(str(bad))
    p = profile.Profile.load(pair[0]["profile"])
    shapes = {k: tuple(v) for k, v in p.shapes.items()}
    p.check_against(shapes, "tiny")
    shapes[p.linears[0]] = (1, 1)
    with pytest.raises(profile.ProfileError, match="does not fit"):
        p.check_against(shapes, "tiny")


def test_config_presets_selection_and_errors(tmp_path, pair):
    paths = pair[0]
    assert [c.fn for c in config.load_configs("bf16")] == ["bf16"]
    with pytest.raises(config.ConfigError, match="fp8: FP8 rollout needs an FP8 W8A8 checkpoint.*fp8_channel"):
        config.load_configs("fp8")
    with pytest.raises(config.ConfigError, match="profile-free FP8"):
        config.RolloutConfig(fn="fp8_vllm").validate("x", check_files=False)
    with pytest.raises(config.ConfigError, match="local FP8 checkpoint"):
        config.RolloutConfig(fn="fp8_channel").validate("x", check_files=False)
    assert config.RolloutConfig(fn="fp8_channel", model="m").is_quantized
    with pytest.raises(config.ConfigError, match="needs a W8A8 checkpoint"):
        config.load_configs("int8")
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load_configs(str(tmp_path / "missing.yaml"))
    with pytest.raises(config.ConfigError, match="never downloads"):
        config.load_configs("LiyuanLucasLiu/Qwen2.5-7B-flashrl/profile.yaml")
    with pytest.raises(config.ConfigError, match="never downloads"):
        config.require_local_dir("Qwen/Qwen2.5-7B-Instruct-quantized.w8a8", "-m/--model")
    cfgs = config.load_configs(paths["config"])
    assert len(cfgs) == 1 and cfgs[0].is_int8 and cfgs[0].model == paths["int8_a"]
    three = [config.RolloutConfig(fn=f) for f in ("int8", "bf16", "int8_prune")]
    assert [config.select(three, r)[0] for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert config.dp_rank(2, {"RANK": "5"}) == 2 and config.dp_rank(1, {}) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("configs:\n- fn: int4\n")
    with pytest.raises(config.ConfigError, match="fn='int4'"):
        config.load_configs(str(bad))
    bad.write_text(f"configs:\n- fn: int8\n  model: {paths['int8_a']}\n  profile: {tmp_path / 'gone.pt'}\n")
    with pytest.raises(config.ConfigError, match="profile"):
        config.load_configs(str(bad))


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def _cli(capsys):
    """`ascend-rl flashrl ...` through the real CLI entry (in process)."""
    from ascend_rl_plugins import cli

    def run(*args):
        code = cli.main(["flashrl", *args])
        out = capsys.readouterr()
        return _Result(code, out.out, out.err)
    return run


def test_cli_subprocess_entry_point_has_the_flashrl_command():
    env = dict(os.environ, ASCEND_RL_AUTOLOAD="0")
    r = subprocess.run([sys.executable, "-m", "ascend_rl_plugins", "flashrl", "setup", "--help"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0 and "--config-output" in r.stdout and "--append" in r.stdout


def test_cli_is_argument_compatible_with_flashrl(pair, tmp_path, _cli):
    paths = pair[0]
    prof_out, cfg_out = str(tmp_path / "profile.pt"), str(tmp_path / "config.yaml")
    r = _cli("profile", "-m", paths["bf16_a"], "-q", paths["int8_a"], "-o", prof_out, "--fn", "int8")
    assert r.returncode == 0, r.stderr
    assert "100.0000%" in r.stdout
    assert torch.equal(profile.Profile.load(prof_out).col_smooth[next(iter(pair[1]["norm"]))],
                       next(iter(pair[1]["norm"].values())))
    r = _cli("setup", "-m", paths["int8_a"], "-p", prof_out, "--fn", "int8", "-o", cfg_out)
    assert r.returncode == 0, r.stderr
    r = _cli("setup", "-a", "--fn", "bf16", "-o", cfg_out)
    assert r.returncode == 0, r.stderr
    cfgs = config.load_configs(cfg_out)
    assert [(c.fn, c.model, c.profile) for c in cfgs] == [("int8", paths["int8_a"], prof_out), ("bf16", None, None)]
    assert cfgs[1].load_format == "dummy"
    # hub ids and missing arguments are clear errors, nothing is downloaded
    r = _cli("profile", "-m", "Qwen/Qwen2.5-7B", "-q", paths["int8_a"], "-o", prof_out)
    assert r.returncode == 2 and "never downloads" in r.stderr
    r = _cli("setup", "--fn", "int8", "-o", cfg_out)
    assert r.returncode == 2 and "-m/--model" in r.stderr
    # the offline quantizer command writes a loadable checkpoint
    r = _cli("quantize", "-m", paths["bf16_a"], "-o", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    assert profile.read_tensors(str(tmp_path / "q"))["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8


def test_flags_aliases_and_validation():
    from ascend_rl_plugins import flags
    from ascend_rl_plugins.features import flashrl
    assert flashrl.CONFIG.read({"FLASHRL_CONFIG": "/x.yaml"}) == "/x.yaml"
    assert flashrl.LOGGING_LEVEL.read({"FLASHRL_LOGGING_LEVEL": "DEBUG"}) == "debug"
    assert flashrl.LMHEAD_FP32.read({"FLASHRL_LMHEAD_FP32": "1"}) is True
    with pytest.raises(flags.FlagError, match="ASCEND_RL_FLASHRL_LOGGING_LEVEL"):
        flashrl.LOGGING_LEVEL.read({"ASCEND_RL_FLASHRL_LOGGING_LEVEL": "loud"})


# -- FP8 (compressed-tensors float-quantized) ------------------------------------------------

def test_fp8_checkpoint_layout_and_profile_round_trip(pair, tmp_path):
    paths, known, a = pair
    q = profile.read_tensors(paths["fp8_a"])
    with open(os.path.join(paths["fp8_a"], "config.json")) as fh:
        qc = json.load(fh)["quantization_config"]
    grp = qc["config_groups"]["group_0"]
    assert qc["format"] == "float-quantized" and grp["weights"]["type"] == "float"
    assert grp["weights"]["strategy"] == "channel" and grp["input_activations"]["type"] == "float"
    assert grp["input_activations"]["dynamic"] and grp["input_activations"]["strategy"] == "token"
    for name, shape in checkpoint.linear_shapes(a).items():
        assert q[name].dtype == torch.float8_e4m3fn and tuple(q[name].shape) == shape
        assert tuple(q[name[:-7] + ".weight_scale"].shape) == (shape[0], 1)
    p = profile.Profile.load(paths["fp8_profile"])
    assert p.fn == "fp8_channel" and p.exact_fraction == 1.0
    for norm, s in known["norm"].items():
        assert torch.equal(p.col_smooth[norm], s), norm
    for down, s in known["down"].items():
        assert torch.equal(p.col_smooth[down], s)
        assert torch.equal(p.row_gain[profile.gain_source(down)], 1.0 / s)
    # online quantization of the update with the derived profile == the offline FP8(B) checkpoint
    online = dict(profile.OnlineQuantizer(p, fn="fp8_channel").transform(profile.read_tensors(paths["bf16_b"]).items()))
    offline = profile.read_tensors(paths["fp8_b"])
    assert set(online) == set(offline)
    for k, v in offline.items():
        got = online[k]
        assert got.dtype == v.dtype and torch.equal(engine_scenario.as_bits(got), engine_scenario.as_bits(v)), k
    # an int8 profile request on an FP8 checkpoint names the mismatch
    with pytest.raises(profile.ProfileError, match="does --fn int8 match"):
        profile.derive_profile(paths["bf16_a"], paths["fp8_a"], fn="int8")


def test_fp8_tensor_strategy_checkpoint(pair, tmp_path):
    paths, known, a = pair
    prof = profile.Profile.from_factors(checkpoint.linear_shapes(a), known["norm"], {}, fn="fp8_tensor")
    out = checkpoint.quantize_checkpoint(paths["bf16_a"], str(tmp_path / "t"), profile=prof, fn="fp8_tensor")
    q = profile.read_tensors(out)
    assert all(q[n[:-7] + ".weight_scale"].shape == (1,) for n in checkpoint.linear_shapes(a))
    derived = profile.derive_profile(paths["bf16_a"], out, fn="fp8_tensor")
    assert derived.exact_fraction == 1.0  # norm smoothing only: recovered exactly
    assert all(torch.equal(derived.col_smooth[n], s) for n, s in known["norm"].items())


def test_cli_fp8(pair, tmp_path, _cli):
    paths = pair[0]
    out = str(tmp_path / "fp8")
    r = _cli("quantize", "-m", paths["bf16_a"], "-o", out, "--fn", "fp8_channel")
    assert r.returncode == 0, r.stderr
    r = _cli("profile", "-m", paths["bf16_a"], "-q", out, "-o", str(tmp_path / "p.pt"), "--fn", "fp8")
    assert r.returncode == 0 and "100.0000%" in r.stdout, r.stderr
    cfg = str(tmp_path / "c.yaml")
    r = _cli("setup", "-m", out, "-p", str(tmp_path / "p.pt"), "--fn", "fp8_channel", "-o", cfg)
    assert r.returncode == 0, r.stderr
    (c,) = config.load_configs(cfg)
    assert c.fn == "fp8_channel" and c.is_fp8 and c.is_quantized and not c.is_int8
    r = _cli("setup", "--fn", "fp8_vllm", "-o", str(tmp_path / "d.yaml"))
    assert r.returncode == 2 and "profile-free FP8" in r.stderr


def test_setup_writes_w4a16_and_block_fp8_configs(tmp_path, _cli):
    """`flashrl setup` accepts every rollout function the config knows, the new INT4 and
    block-FP8 ones included (their engine-start checks run later, in the engine)."""
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for fn in ("w4a16", "fp8_block"):
        out = str(tmp_path / f"{fn}.yaml")
        r = _cli("setup", "-m", str(model), "--fn", fn, "-o", out)
        assert r.returncode == 0, r.stderr
        assert [c.fn for c in config.load_configs(out)] == [fn]
    r = _cli("setup", "--fn", "w4a16", "-o", str(tmp_path / "none.yaml"))
    assert r.returncode == 2 and "-m/--model" in r.stderr
