"""rollout_mismatch.metric and ``ascend-rl mismatch``: definitions, robustness, inputs (both stacks)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from ascend_rl_plugins.features.rollout_mismatch import metric
from ascend_rl_plugins.features.rollout_mismatch.metric import MismatchError, mismatch
from tests.support.child import REPO


def _pair(n=2000, noise=0.03, seed=0):
    rng = np.random.default_rng(seed)
    rollout = -rng.gamma(2.0, 1.0, size=n)
    return rollout + rng.normal(0.0, noise, size=n), rollout


def test_identical_log_probs_have_zero_mismatch():
    t, _ = _pair()
    s = mismatch(t, t)
    assert s["tokens"] == t.size
    for key in ("abs_delta_mean", "abs_delta_p99", "abs_delta_max", "k1", "k2", "k3", "chi2_token",
                "share_outside_clip", "share_ratio_above_2"):
        assert s[key] == 0.0, key


def test_estimators_are_verls_token_level_definitions():
    """verl 0.9.1 rollout_corr_helper: log_ratio = old (trainer) - rollout, clamped to +-20;
    k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio."""
    trainer = np.array([-1.0, -2.0, -0.5, -30.0])
    rollout = np.array([-1.5, -1.0, -0.5, -1.0])
    lr = np.clip(trainer - rollout, -20, 20)    # [0.5, -1, 0, -20]: the last one clamped
    s = mismatch(trainer, rollout)
    assert s["k1"] == pytest.approx(np.mean(-lr))
    assert s["k2"] == pytest.approx(np.mean(0.5 * lr ** 2))
    assert s["k3"] == pytest.approx(np.mean(np.exp(lr) - 1 - lr))
    assert s["chi2_token"] == pytest.approx(np.mean(np.exp(lr) ** 2) - 1)
    assert s["abs_delta_max"] == 29.0          # |delta| itself is not clamped
    # ratio exp(0.5) = 1.65 and exp(-1), exp(-20) leave [0.8, 1.2]; exp(0) = 1 does not
    assert s["share_outside_clip"] == 0.75
    assert s["share_ratio_above_2"] == 0.0 and s["share_ratio_below_half"] == 0.5


def test_estimators_agree_with_verl_where_it_is_installed():
    torch = pytest.importorskip("torch")
    try:
        from verl.trainer.ppo import rollout_corr_helper as rc
    except Exception as exc:  # verl 0.6.1 has no rollout correction module
        pytest.skip(f"verl's rollout correction helper is not importable here: {exc}")
    trainer, rollout = _pair(500, noise=0.3, seed=4)
    old, roll = torch.tensor(trainer)[None], torch.tensor(rollout)[None]
    ref = rc.compute_offpolicy_metrics(old, roll, torch.ones_like(old))
    s = mismatch(trainer, rollout)
    assert s["k1"] == pytest.approx(ref["kl"], rel=1e-9)
    assert s["k3"] == pytest.approx(ref["k3_kl"], rel=1e-9)
    assert s["chi2_token"] == pytest.approx(ref["chi2_token"], rel=1e-9)


def test_a_single_outlier_token_does_not_dominate_the_robust_statistics():
    trainer, rollout = _pair()
    clean = mismatch(trainer, rollout)
    spoiled = trainer.copy()
    spoiled[123] -= 50.0                           # one token the rollout found likely, the trainer not
    dirty = mismatch(spoiled, rollout)
    assert dirty["abs_delta_max"] > 40 and dirty["abs_delta_mean"] > 1.5 * clean["abs_delta_mean"]
    for key in ("abs_delta_median", "abs_delta_trimmed_mean", "abs_delta_p99"):
        assert dirty[key] == pytest.approx(clean[key], rel=0.05), key
    assert dirty["share_outside_clip"] - clean["share_outside_clip"] <= 1.0 / trainer.size + 1e-12


def test_the_mask_selects_tokens_and_masked_padding_may_be_anything():
    trainer, rollout = _pair(100)
    t = np.stack([trainer, trainer])
    r = np.stack([rollout, np.full(100, np.nan)])  # second row: padding
    m = np.stack([np.ones(100), np.zeros(100)])
    assert mismatch(t, r, m) == mismatch(trainer, rollout)
    with pytest.raises(MismatchError, match="200 masked tokens have a non-finite|100 of 200 masked tokens"):
        mismatch(t, r)


def test_torch_bf16_inputs():
    torch = pytest.importorskip("torch")
    trainer, rollout = _pair(64)
    t = torch.tensor(trainer).to(torch.bfloat16)
    s = mismatch(t, torch.tensor(rollout))
    assert s["abs_delta_mean"] == pytest.approx(np.mean(np.abs(t.double().numpy() - rollout)))


@pytest.mark.parametrize("args, message", [
    (dict(trainer=[0.0, 1.0], rollout=[0.0]), "differ in shape"),
    (dict(trainer=[0.0], rollout=[0.0], mask=[0]), "mask is empty"),
    (dict(trainer=[0.0], rollout=[0.0], clip=1.5), "clip=1.5"),
])
def test_bad_inputs_are_refused_with_a_reason(args, message):
    with pytest.raises(MismatchError, match=message):
        mismatch(**args)


class _Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(*args):
    """``ascend-rl mismatch ...`` through the command's own entry (ascend_rl_plugins.cli.main,
    in this process: the command applies no patch); the engine test runs it as a process."""
    import contextlib
    import io

    from ascend_rl_plugins.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["mismatch", *args])
        except SystemExit as exc:   # argparse errors
            code = exc.code
    return _Run(code, out.getvalue(), err.getvalue())


def test_the_subcommand_is_registered_on_the_ascend_rl_command():
    out = subprocess.run([sys.executable, "-m", "ascend_rl_plugins", "mismatch", "--help"], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0 and "--trainer" in out.stdout and ".jsonl" in out.stdout, out.stderr


def test_cli_on_npy_with_mask_and_on_ragged_jsonl(tmp_path):
    trainer, rollout = _pair(60)
    np.save(tmp_path / "t.npy", trainer.reshape(3, 20))
    np.save(tmp_path / "r.npy", rollout.reshape(3, 20))
    mask = np.ones((3, 20))
    mask[2, 10:] = 0
    np.save(tmp_path / "m.npy", mask)
    out = _cli("--trainer", str(tmp_path / "t.npy"), "--rollout", str(tmp_path / "r.npy"),
               "--mask", str(tmp_path / "m.npy"), "--clip", "0.1", "--json")
    assert out.returncode == 0, out.stderr
    want = mismatch(trainer.reshape(3, 20), rollout.reshape(3, 20), mask, clip=0.1)
    assert json.loads(out.stdout) == pytest.approx(want)
    # ragged jsonl: null (vLLM's first prompt position) is left out of both sides
    rows_t = [[None] + list(trainer[:9]), list(trainer[9:60])]
    rows_r = [[None] + list(rollout[:9]), list(rollout[9:60])]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_t))
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_r))
    out = _cli("--trainer", str(tmp_path / "t.jsonl"), "--rollout", str(tmp_path / "r.jsonl"))
    assert out.returncode == 0, out.stderr
    text = dict(line.split() for line in out.stdout.strip().splitlines())
    assert int(text["tokens"]) == 60
    assert math.isclose(float(text["abs_delta_mean"]), mismatch(trainer, rollout)["abs_delta_mean"], rel_tol=1e-5)


def test_cli_errors_name_the_problem(tmp_path):
    (tmp_path / "t.jsonl").write_text("[1.0, 2.0]\n")
    (tmp_path / "r.jsonl").write_text("[1.0]\n")
    out = _cli("--trainer", str(tmp_path / "t.jsonl"), "--rollout", str(tmp_path / "r.jsonl"))
    assert out.returncode == 2 and "sequence 0: lengths differ (trainer 2, rollout 1)" in out.stderr
    out = _cli("--trainer", str(tmp_path / "missing.pt"), "--rollout", str(tmp_path / "r.jsonl"))
    assert out.returncode == 2 and "missing.pt does not exist" in out.stderr


def test_cli_reads_torch_files(tmp_path):
    torch = pytest.importorskip("torch")
    trainer, rollout = _pair(40)
    torch.save(torch.tensor(trainer), tmp_path / "t.pt")
    torch.save([torch.tensor(rollout[:15]), torch.tensor(rollout[15:])], tmp_path / "r_list.pt")
    torch.save(torch.tensor(rollout), tmp_path / "r.pt")
    out = _cli("--trainer", str(tmp_path / "t.pt"), "--rollout", str(tmp_path / "r.pt"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["k3"] == pytest.approx(mismatch(trainer, rollout)["k3"])
    out = _cli("--trainer", str(tmp_path / "t.pt"), "--rollout", str(tmp_path / "r_list.pt"))
    assert out.returncode == 2 and "mix of ragged" in out.stderr


def test_keys_are_documented():
    assert set(metric.KEYS) == set(mismatch([0.0, 1.0], [0.0, 1.0]))
