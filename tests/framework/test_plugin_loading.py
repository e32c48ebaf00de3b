"""The plugin is loaded through the real ``vllm.general_plugins`` path inside real engines,
and importing the package stays cheap."""

import json
import sys

import pytest

from helpers import ENGINE_ENV, run_python, vllm_version


def test_import_does_not_pull_heavy_packages():
    result = run_python("""
        import sys
        import ascend_rl_plugins
        from ascend_rl_plugins.patching.core import REGISTRY
        emit({"heavy": sorted(m for m in ("torch", "vllm", "verl", "numpy", "numba", "megatron")
                              if m in sys.modules),
              "activated": ascend_rl_plugins.plugin.activated_by(),
              "patches": len(REGISTRY.patches)})
    """, env={"ASCEND_RL_AUTOLOAD": "1", "ASCEND_RL_DIAGNOSTICS": "/dev/null"})
    assert result["heavy"] == []
    assert result["activated"] == ["import ascend_rl_plugins"]
    assert result["patches"] > 0


def test_entry_points_are_declared():
    from importlib.metadata import entry_points
    vllm_eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    verl_eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert vllm_eps.get("ascend_rl") == "ascend_rl_plugins.plugin:vllm_general_plugin"
    assert verl_eps.get("ascend_rl") == "ascend_rl_plugins.verl_entry"


def test_verl_style_entry_point_load_activates():
    # verl >= 0.9 only calls entry_point.load(); loading must be enough.
    result = run_python("""
        from importlib.metadata import entry_points
        ep = [e for e in entry_points(group="verl.plugins") if e.name == "ascend_rl"][0]
        ep.load()
        import ascend_rl_plugins
        emit(ascend_rl_plugins.plugin.activated_by())
    """, env={"ASCEND_RL_AUTOLOAD": "0"})
    assert result == ["verl.plugins"]


@pytest.mark.engine
@pytest.mark.skipif(vllm_version() is None, reason="needs vLLM")
def test_vllm_loads_the_plugin_in_the_engine_core_process(tmp_path, tiny_model_path):
    """Multiprocess engine core (verl 0.9 server style) and in-process engine (verl 0.6
    spmd style): in both, the process that runs EngineCore.step has ascend-rl active,
    activated by vLLM's general-plugin loader, with the diagnostic patch applied."""
    report = tmp_path / "diag.jsonl"
    code = f"""
        import os
        from vllm import LLM, SamplingParams
        def run(mp):
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mp else "0"
            llm = LLM(model={tiny_model_path!r}, enforce_eager=True, max_model_len=256, max_num_seqs=4,
                      seed=0)
            out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0))
            n = len(out[0].outputs[0].token_ids)
            del llm
            return n
        if __name__ == "__main__":
            emit({{"pid": os.getpid(), "mp": run(True), "inproc": run(False)}})
    """
    env = dict(ENGINE_ENV, ASCEND_RL_DIAGNOSTICS=str(report), ASCEND_RL_AUTOLOAD="0")
    script = tmp_path / "drive.py"
    prelude = ("import json as _json\n"
               "def emit(obj):\n    print('@@ASCEND_RL_RESULT@@' + _json.dumps(obj), flush=True)\n")
    import textwrap
    script.write_text(prelude + textwrap.dedent(code))
    result = run_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", env=env)
    records = [json.loads(line) for line in report.read_text().splitlines()]
    driver = result["pid"]
    pids = {r["pid"] for r in records}
    assert len(records) == 2 and driver in pids and len(pids - {driver}) == 1, records
    for r in records:
        assert r["activated_by"][0] == "vllm.general_plugins"
        states = {p["patch"]: p["state"] for p in r["patches"]}
        assert "applied" in (states["diagnostics.report_on_first_step"],
                             states["diagnostics.report_on_first_step_with_batch_queue"])
