"""A real Prometheus server scrapes a real manager and a real (CPU) worker while the reference
scheduler serves requests; what Prometheus reports is checked against the manager's own stats.

The worker is found the way a deployment finds it: through the manager's /sd/workers (HTTP
service discovery). Prometheus is Debian's, unpacked by `make tools` (tests/support/fetch_tools.py;
the test is skipped, saying why, where it could not be fetched), started for the test with its
own files and stopped after it. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import json
import pathlib
import time

import pytest

from kvpager import client as C
from kvpager.commands.demo import make_requests
from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.scheduler import Scheduler
from kvpager.scheduler.reference import generate_contiguous
from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
from kvpager.worker.model import Decoder, ModelConfig
from tests.support.prometheus import PrometheusServer
from tests.support.promql import dashboard_queries, grafana_to_promql, metric_names

REPO = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvpager.json"
MODEL = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, seed=3)
BLOCK = 8


def prometheus_config(manager_metrics: str) -> str:
    return f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: kvpager-manager
    static_configs:
      - targets: ["{manager_metrics}"]
  - job_name: kvpager-workers
    http_sd_configs:
      - url: http://{manager_metrics}/sd/workers
        refresh_interval: 1s
"""


@pytest.fixture
def stack(unpacked_tools, tmp_path):
    """Manager (pools sized from the worker), one CPU worker, both serving /metrics, and
    Prometheus scraping them. Yields (client, service, worker, prometheus)."""
    prometheus_bin = unpacked_tools.require("prometheus")
    config = ManagerConfig(block_size=BLOCK, num_gpu_blocks=0, num_cpu_blocks=0, watermark=0.0)
    server, port, service, _ = create_server(config, "127.0.0.1:0")
    server.start()
    metrics = service.serve_metrics("127.0.0.1", 0)
    client = C.BlockManagerClient(f"127.0.0.1:{port}", timeout=10)
    worker = CacheWorker(WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=48, num_cpu_blocks=96,
                                      manager_address=client.target, metrics_port=0, device="cpu"))
    worker.start()
    try:
        with PrometheusServer(prometheus_config(metrics.address), tmp_path, binary=prometheus_bin) as prometheus:
            yield client, service, worker, prometheus
    finally:
        worker.stop()
        client.close()
        server.stop(None)
        service.close()


def latest(prometheus: PrometheusServer, expr: str) -> dict[str, float]:
    """{label set as text: value} of an instant query."""
    return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in prometheus.query(expr)}


def scalar(prometheus: PrometheusServer, expr: str) -> float:
    values = list(latest(prometheus, expr).values())
    assert len(values) == 1, f"{expr}: expected one series, got {values}"
    return values[0]


def wait_until_scraped(prometheus: PrometheusServer, expected: dict[str, float], timeout: float = 30.0) -> None:
    """Wait until every expression's latest value in Prometheus equals the expected one (a
    scrape after the workload ended)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {}
        for expr, want in expected.items():
            got = latest(prometheus, expr)
            seen[expr] = list(got.values())
        if all(len(v) == 1 and v[0] == pytest.approx(expected[e]) for e, v in seen.items()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus never reported the expected values: want {expected}, saw {seen}")
        time.sleep(0.5)


def test_prometheus_reports_what_the_manager_reports(stack):
    client, service, worker, prometheus = stack
    prometheus.wait_for('up{job="kvpager-manager"} == 1', timeout=30)
    prometheus.wait_for('up{job="kvpager-workers"} == 1', timeout=30)

    # Serve requests (prefix sharing, forks, swap preemption in a 48-block pool), then leave a
    # known state behind: three sequences on the GPU and one swapped out to the CPU.
    requests = [r for _, r in make_requests(16, seed=5)]  # token ids < 256
    model_steps = []

    def runner(inp):
        model_steps.append(inp)
        return worker.execute_model(inp)

    scheduler = Scheduler(client, runner, BLOCK)
    outputs = scheduler.run(requests)
    expected = generate_contiguous(Decoder(MODEL), requests)
    assert all(outputs[r.request_id].samples == expected[r.request_id] for r in requests)
    for i, n in enumerate((5, 17, 30, 41)):
        client.allocate(f"held-{i}", token_ids=[(i * 7 + t) % MODEL.vocab_size for t in range(n)])
    client.swap_out(["held-3"])
    st = client.get_stats()
    assert st.gpu.used_blocks > 0 and st.cpu.used_blocks > 0 and st.preemptions > 0

    wait_until_scraped(prometheus, {
        'kvpager_kv_cache_usage_ratio{tier="gpu"}': st.gpu_utilization,
        'kvpager_kv_cache_usage_ratio{tier="cpu"}': st.cpu.used_blocks / st.cpu.total_blocks,
        'kvpager_kv_cache_blocks{tier="gpu",state="used"}': st.gpu.used_blocks,
        'kvpager_kv_cache_blocks{tier="gpu",state="cached"}': st.gpu.cached_blocks,
        'kvpager_kv_cache_fragmentation_ratio': st.internal_fragmentation,
        'kvpager_sequences{state="running"}': st.running_sequences,
        'kvpager_sequences{state="swapped"}': 1,
        'kvpager_prefix_cache_hit_tokens_total': st.prefix_hit_tokens,
        'kvpager_preemptions_total': st.preemptions,
        'kvpager_swapped_blocks_total{direction="out"}': st.blocks_swapped_out,
        'kvpager_workers_registered': 1,
        # The worker moved exactly the blocks the manager planned, and as many bytes.
        'kvpager_worker_moved_blocks_total{direction="gpu_to_cpu"}': st.blocks_swapped_out,
        'kvpager_worker_moved_blocks_total{direction="cpu_to_gpu"}': st.blocks_swapped_in,
        'kvpager_worker_moved_blocks_total{direction="gpu_to_gpu"}': st.cow_copies,
        'kvpager_worker_model_steps_total': len(model_steps),
        'kvpager_worker_computed_tokens_total': scheduler.stats.tokens_computed,
    })
    block_bytes = worker.cache.spec.block_bytes
    assert scalar(prometheus, 'kvpager_swapped_bytes_total{direction="out"}') == st.blocks_swapped_out * block_bytes
    assert scalar(prometheus, 'kvpager_worker_moved_bytes_total{direction="gpu_to_cpu"}') == \
        st.blocks_swapped_out * block_bytes
    assert scalar(prometheus, 'kvpager_worker_cache_bytes{tier="gpu"}') == worker.cache.blocks.nbytes
    # The worker's series carry the rank from service discovery.
    (labels,) = [json.loads(k) for k in latest(prometheus, "kvpager_worker_plans_total")]
    assert labels["rank"] == "0" and labels["job"] == "kvpager-workers"
    # Not the worker id, which changes at each registration: Prometheus shows it on the target only.
    assert not [name for name in labels if "worker_id" in name]
    (target,) = [t for t in prometheus.targets() if t["labels"]["job"] == "kvpager-workers"]
    assert target["discoveredLabels"]["__meta_kvpager_worker_id"] == worker.worker_id
    assert scalar(prometheus, 'sum(kvpager_rpc_requests_total{method="Step",code="OK"})') >= scheduler.stats.steps

    # The shipped Grafana dashboard on this live stack: every expression evaluates, and every
    # metric it reads has series here (failure counters included: the workload above made none,
    # so two refused requests are made first).
    for request in (lambda: client.free("no-such-sequence"), lambda: client.allocate("held-1", num_tokens=3)):
        with pytest.raises(Exception):
            request()
    prometheus.wait_for("kvpager_operation_failures_total", timeout=30)
    queries = [grafana_to_promql(expr) for _, expr in dashboard_queries(DASHBOARD)]
    assert queries
    for query in queries:
        prometheus.query(query)  # raises PromQLError on a bad expression
    names = set().union(*(metric_names(q) for q in queries))
    absent = sorted(n for n in names if not prometheus.query(f"count({{__name__={json.dumps(n)}}})"))
    assert not absent, f"the dashboard reads metrics a live manager and worker do not export: {absent}"

    client.free("held-0")
    with service.lock:
        service.manager.check_invariants()
