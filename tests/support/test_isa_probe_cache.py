"""The test-harness ISA-probe cache (tests/support/isa_probe_cache.py) gives TorchInductor the
same answer as torch's own checks, and the second process on a machine runs none of them."""

import json
import os
from dataclasses import asdict, replace

import pytest

from tests.support import isa_probe_cache
from tests.support.child import run_scenario

SCENARIO = ("tests.support.isa_probe_cache", "torch_vec_isa_answer")


def _answer(**env) -> dict:
    return run_scenario(*SCENARIO, env=env, timeout=600)


@pytest.mark.parametrize("simulated", ["", "avx2"], ids=["host-cpu", "simulated-avx2"])
def test_cached_answer_is_torchs_own(simulated, tmp_path):
    """A process with an empty cache (its own ``ASCEND_RL_CACHE``) answers exactly as torch does:
    every check is torch's own, run and passed through, and recorded. The next process answers
    the same from the records alone. (No separate cache-off child: the cold one already pays
    torch's full probe, the cost this cache exists to save.)"""
    pytest.importorskip("torch")
    pytest.importorskip("wrapt")
    env = {"ARP_TEST_ISA_PROBE_CACHE": "1", "ARP_TEST_CPU_ISA": simulated, "ASCEND_RL_CACHE": str(tmp_path)}
    torch_own = _answer(**env)  # cold: nothing remembered yet
    cached = _answer(**env)
    assert torch_own["installed"] and cached["installed"]
    decision = ("valid", "picked", "picked_true", "picked_flags")
    assert {k: cached[k] for k in decision} == {k: torch_own[k] for k in decision}, (torch_own, cached)
    assert torch_own["counts"]["from_cache"] == 0, torch_own
    if torch_own["valid"]:  # an x86 / ARM CPU with a vector ISA: torch checked builds
        assert torch_own["counts"]["run_by_torch"] > 0, torch_own
        assert cached["counts"] == {"from_cache": cached["counts"]["from_cache"], "run_by_torch": 0}, cached
        assert cached["counts"]["from_cache"] > 0, cached
    if simulated:
        assert not any("avx512" in isa for isa in torch_own["valid"]), torch_own


def test_switched_off_it_is_not_installed():
    result = run_scenario("tests.support.isa_probe_cache", "modules_after_install",
                          env={"ARP_TEST_ISA_PROBE_CACHE": "0"}, timeout=120)
    assert result == {"installed": False, "torch_imported": False}


KEY = isa_probe_cache.CheckKey(
    torch_version="2.11.0", torch_git_version="abc", python="/venv/bin/python", python_version="3.11",
    machine="x86_64", cpu_flags="avx2 avx512f", simulated_cpu_isa="", compiler="g++",
    compiler_version="13", environment="{}", isa="avx2", arch_flags="-mavx2 -mfma",
    probe_source_sha256="0" * 64)


def test_remembers_only_what_it_wrote_for_the_same_key(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_RL_CACHE", str(tmp_path))
    assert not isa_probe_cache.remembered_success(KEY)
    isa_probe_cache.remember_success(KEY)
    assert isa_probe_cache.remembered_success(KEY)
    for changed in (replace(KEY, compiler_version="14"), replace(KEY, simulated_cpu_isa="avx2"),
                    replace(KEY, arch_flags="-mavx2 -mfma -mavx512bf16"), replace(KEY, cpu_flags="avx2")):
        assert not isa_probe_cache.remembered_success(changed)
    root = tmp_path / "torchinductor-vec-isa"
    assert [p.name for p in root.iterdir()] == [KEY.file_name()]  # no temporary file left behind


@pytest.mark.parametrize("content", ["", "{not json", json.dumps({"key": {}, "passed": True}),
                                     "KEYED_FALSE"], ids=["empty", "corrupt", "other-key", "failed"])
def test_unreadable_or_foreign_records_are_not_trusted(tmp_path, monkeypatch, content):
    monkeypatch.setenv("ASCEND_RL_CACHE", str(tmp_path))
    root = tmp_path / "torchinductor-vec-isa"
    root.mkdir()
    if content == "KEYED_FALSE":
        content = json.dumps({"key": asdict(KEY), "passed": False})
    (root / KEY.file_name()).write_text(content)
    assert not isa_probe_cache.remembered_success(KEY)


def test_switch_accepts_only_0_and_1(monkeypatch):
    for value, on in (("", True), ("1", True), ("0", False)):
        monkeypatch.setenv(isa_probe_cache.ENV, value)
        assert isa_probe_cache.enabled() is on
    monkeypatch.setenv(isa_probe_cache.ENV, "yes")
    with pytest.raises(ValueError, match="ARP_TEST_ISA_PROBE_CACHE='yes': accepted values are 1"):
        isa_probe_cache.enabled()


def test_installing_imports_no_torch():
    """The hook waits for torch's own import: a process that never imports torch stays free of it."""
    result = run_scenario("tests.support.isa_probe_cache", "modules_after_install", timeout=120)
    assert result == {"installed": True, "torch_imported": False}
