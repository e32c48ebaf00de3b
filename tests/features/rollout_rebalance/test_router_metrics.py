"""The router's reader of vLLM's Prometheus /metrics, and what it does with them.

The exposition here is a double of a vLLM 0.23 server's (prometheus_client, the library vLLM
uses, writing gauges/histograms under vLLM's metric names and labels); the names are checked
against the installed vLLM's own metric definitions, so a rename upstream fails this test."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest

from ascend_rl_plugins.features.rollout_rebalance import router

prometheus_client = pytest.importorskip("prometheus_client")

NAMES = ("vllm:cache_config_info", "vllm:kv_cache_usage_perc", "vllm:request_generation_tokens")


def _vllm_exposition(engines: dict[str, tuple[int, int, float]], generated: list[int]) -> str:
    """engines: engine index -> (num_gpu_blocks, block_size, usage)."""
    reg = prometheus_client.CollectorRegistry()
    info = prometheus_client.Gauge("vllm:cache_config_info", "cache config",
                                   ["engine", "num_gpu_blocks", "block_size", "model_name"], registry=reg)
    usage = prometheus_client.Gauge("vllm:kv_cache_usage_perc", "KV-cache usage", ["engine", "model_name"],
                                    registry=reg)
    hist = prometheus_client.Histogram("vllm:request_generation_tokens", "generated", ["engine", "model_name"],
                                       buckets=(1, 10, 100, 1000, 10000), registry=reg)
    for e, (blocks, size, used) in engines.items():
        info.labels(engine=e, num_gpu_blocks=str(blocks), block_size=str(size), model_name="m").set(1)
        usage.labels(engine=e, model_name="m").set(used)
    for i, n in enumerate(generated):
        hist.labels(engine=str(i % len(engines)), model_name="m").observe(n)
    return prometheus_client.generate_latest(reg).decode()


def test_the_names_read_are_vllms_own():
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed here")
    source = open(os.path.join(os.path.dirname(spec.origin), "v1", "metrics", "loggers.py")).read()
    for name in NAMES:
        assert f'"{name}"' in source, name


def test_parse_sums_engines_and_reads_the_mean_length():
    text = _vllm_exposition({"0": (1000, 16, 0.5), "1": (1000, 16, 0.25)}, [100, 300])
    m = router.parse_metrics(text)
    assert m.kv_capacity_tokens == 32000 and m.kv_used_tokens == 8000 + 4000
    assert m.generation_tokens_sum == 400 and m.generation_requests == 2


def test_no_cache_info_means_no_report():
    assert router.parse_metrics("# nothing here\n") is None


def test_metrics_feed_the_policy():
    shell = router.ExpectedWorkRouter({"a:1": object(), "b:2": object()}, {"kv_budget": 1})
    shell.apply_metrics("a:1", router.parse_metrics(_vllm_exposition({"0": (100, 16, 0.5)}, [50, 150])))
    books = shell._policy.replicas["a:1"]
    assert (books.kv_capacity_tokens, books.kv_used_tokens) == (1600, 800)
    assert shell._policy.mean_response_tokens == 100


class _RolloutConfig:  # the fields of verl's RolloutConfig the router reads
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_load_metrics_with_stats_off_is_refused_naming_the_fix():
    shell = router.ExpectedWorkRouter({"a:1": object()}, {"load": "metrics"})
    with pytest.raises(ValueError, match=r"disable_log_stats.*accepted: 'auto', 'metrics', 'requests'"):
        shell.apply_rollout_config(_RolloutConfig(full_determinism=False, max_num_seqs=8,
                                                  response_length=64, disable_log_stats=True))


def test_auto_uses_metrics_only_when_published(caplog):
    shell = router.ExpectedWorkRouter({"a:1": object()}, {})
    with caplog.at_level("WARNING", logger="ascend_rl_plugins"):
        shell.apply_rollout_config(_RolloutConfig(full_determinism=False, max_num_seqs=8,
                                                  response_length=64, disable_log_stats=True))
    assert not shell._use_metrics and "disable_log_stats=False" in caplog.text
    shell = router.ExpectedWorkRouter({"a:1": object()}, {})
    shell.apply_rollout_config(_RolloutConfig(full_determinism=False, max_num_seqs=8,
                                              response_length=64, disable_log_stats=False))
    assert shell._use_metrics and shell._policy.replicas["a:1"].slots == 8


def test_the_poller_reads_a_server_over_http():
    """One poll over real HTTP (a local server serving the exposition double)."""
    import http.server
    import threading
    text = _vllm_exposition({"0": (200, 16, 0.5)}, [10])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = text.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        shell = router.ExpectedWorkRouter({address: object()}, {"metrics_interval_s": 0.05})

        async def one_poll():
            task = asyncio.get_running_loop().create_task(shell._poll_metrics())
            for _ in range(100):
                await asyncio.sleep(0.02)
                if shell._policy.replicas[address].kv_capacity_tokens:
                    break
            task.cancel()
        asyncio.run(one_poll())
        assert shell._policy.replicas[address].kv_capacity_tokens == 3200
        assert shell._policy.replicas[address].kv_used_tokens == 1600
    finally:
        server.shutdown()
