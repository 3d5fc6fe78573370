"""The manager's /metrics and /sd/workers, scraped over HTTP from a real server after a known
workload; every figure is checked against the workload and against GetStats.

Pool (conftest's ``served``): block size 4, 16 GPU blocks, 8 CPU blocks, no watermark.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from kvpager import client as C
from kvpager import errors
from kvpager.metrics_http import scrape
from kvpager.v1 import block_manager_pb2 as pb
from tests.support.catalog import check_exports, scrape_families


def value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def metrics_url(served):
    client, service = served
    server = service.serve_metrics("127.0.0.1", 0)
    yield client, service, f"http://127.0.0.1:{server.port}"


def workload(client) -> None:
    """Two prompts sharing a prefix, a fork and a copy-on-write append, a swap out and in,
    and refused requests of three kinds."""
    client.allocate("a", token_ids=list(range(10)))                 # 3 blocks, 2 full ones queried
    client.allocate("b", token_ids=list(range(8)) + [50, 51])      # hits 2 blocks (8 tokens)
    client.fork("a", "a2")
    client.append("a2", token_ids=[7])                             # last block shared: one copy
    client.step([C.append_batch_op(["a", "b", "nope"], [1, 2, 3])])  # 2 applied, 1 NOT_FOUND
    client.swap_out(["b"])                                         # a preemption
    client.swap_in(["b"])
    with pytest.raises(errors.NotFound):
        client.free("ghost")
    with pytest.raises(errors.AlreadyExists):
        client.allocate("a", num_tokens=3)
    with pytest.raises(errors.ResourceExhausted):
        client.allocate("big", num_tokens=4 * 14)
    client.free("a2")


def test_scrape_matches_the_workload_and_get_stats(metrics_url):
    client, _, url = metrics_url
    workload(client)
    st = client.get_stats()
    m = scrape(url + "/metrics")

    for tier, t in (("gpu", st.gpu), ("cpu", st.cpu)):
        assert value(m, "kvpager_kv_cache_capacity_blocks", tier=tier) == t.total_blocks
        for state in ("used", "free", "cached"):
            assert value(m, "kvpager_kv_cache_blocks", tier=tier, state=state) == getattr(t, f"{state}_blocks")
        assert value(m, "kvpager_kv_cache_usage_ratio", tier=tier) == pytest.approx(t.used_blocks / t.total_blocks)
    assert value(m, "kvpager_kv_cache_usage_ratio", tier="gpu") == pytest.approx(st.gpu_utilization)
    assert value(m, "kvpager_kv_cache_fragmentation_ratio") == pytest.approx(st.internal_fragmentation)
    assert value(m, "kvpager_sequences", state="running") == st.running_sequences == 2
    assert value(m, "kvpager_sequences", state="swapped") == 0
    assert value(m, "kvpager_pool_ready") == 1

    ops = {op: value(m, "kvpager_operations_total", op=op) for op in
           ("allocate", "append", "fork", "free", "swap_out", "swap_in", "copy_on_write")}
    assert ops == {"allocate": 2, "append": 3, "fork": 1, "free": 1, "swap_out": 1, "swap_in": 1,
                   "copy_on_write": 1}
    assert value(m, "kvpager_operation_failures_total", op="append", code="NOT_FOUND") == 1
    assert value(m, "kvpager_operation_failures_total", op="free", code="NOT_FOUND") == 1
    assert value(m, "kvpager_operation_failures_total", op="allocate", code="ALREADY_EXISTS") == 1
    assert value(m, "kvpager_operation_failures_total", op="allocate", code="RESOURCE_EXHAUSTED") == 1

    assert value(m, "kvpager_prefix_cache_queried_tokens_total") == st.prefix_query_tokens == 20
    assert value(m, "kvpager_prefix_cache_hit_tokens_total") == st.prefix_hit_tokens == 8
    assert value(m, "kvpager_prefix_cache_queried_blocks_total") == st.prefix_query_blocks == 4
    assert value(m, "kvpager_prefix_cache_hit_blocks_total") == st.prefix_hit_blocks == 2
    assert value(m, "kvpager_preemptions_total") == st.preemptions == 1
    assert value(m, "kvpager_swapped_blocks_total", direction="out") == st.blocks_swapped_out == 3
    assert value(m, "kvpager_swapped_blocks_total", direction="in") == st.blocks_swapped_in
    assert value(m, "kvpager_steps_total") == st.steps

    # RPCs by method and status, as the client saw them.
    assert value(m, "kvpager_rpc_requests_total", method="Allocate", code="OK") == 2
    assert value(m, "kvpager_rpc_requests_total", method="Allocate", code="ALREADY_EXISTS") == 1
    assert value(m, "kvpager_rpc_requests_total", method="Allocate", code="RESOURCE_EXHAUSTED") == 1
    assert value(m, "kvpager_rpc_requests_total", method="Free", code="NOT_FOUND") == 1
    assert value(m, "kvpager_rpc_duration_seconds_count", method="Allocate") == 4
    assert value(m, "kvpager_rpc_duration_seconds_bucket", method="Step", le="+Inf") == 1
    (info,) = [dict(labels) for name, labels in m if name == "kvpager_manager_info"]
    assert info["block_size"] == "4" and info["prefix_caching"] == "true" and info["version"]


def test_every_documented_manager_metric_is_exported(metrics_url):
    client, _, url = metrics_url
    workload(client)
    # Both ways, with types and labels: docs/metrics.md's Manager table is what a scrape has.
    check_exports(scrape_families(url.removeprefix("http://")), "Manager")


def test_a_rank_that_registers_again_and_again_adds_no_series(metrics_url):
    """Each registration gives a new worker id; /sd/workers names it only as a ``__meta_`` label
    (dropped by Prometheus after relabeling), so the labels every series of the worker gets, and
    the manager's own series, stay the same however often rank 0 comes back."""
    client, service, url = metrics_url

    def register() -> str:
        return client.stub.RegisterWorker(pb.RegisterWorkerRequest(
            address="127.0.0.1:40000", rank=0, tensor_parallel_size=1, num_gpu_blocks=17, num_cpu_blocks=8,
            block_size=4, metrics_address="127.0.0.1:9501", block_bytes=1024), timeout=5).worker_id

    def series_labels() -> list[dict[str, str]]:
        """The labels a scrape of each target gives its series (Prometheus drops ``__*`` ones)."""
        with urllib.request.urlopen(url + "/sd/workers", timeout=5) as reply:
            return [{k: v for k, v in group["labels"].items() if not k.startswith("__")} for group in json.load(reply)]

    register()
    labels, manager_series = series_labels(), set(scrape(url + "/metrics"))
    ids = {register() for _ in range(5)}
    assert len(ids) == 5                                  # a new id each time...
    assert series_labels() == labels == [{"rank": "0"}]   # ...that no series carries
    with urllib.request.urlopen(url + "/sd/workers", timeout=5) as reply:
        (group,) = json.load(reply)
    assert group["labels"]["__meta_kvpager_worker_id"] == service.registry.workers()[0].worker_id
    assert set(scrape(url + "/metrics")) == manager_series


def test_a_rolled_back_step_counts_as_failures_not_operations(metrics_url):
    client, _, url = metrics_url
    client.allocate("a", num_tokens=4)
    reply = client.step([C.append_op("a", num_tokens=1), C.free_op("ghost")], all_or_nothing=True)
    assert not reply.applied
    m = scrape(url + "/metrics")
    assert value(m, "kvpager_operations_total", op="append") == 0
    assert value(m, "kvpager_operation_failures_total", op="append", code="ABORTED") == 1
    assert value(m, "kvpager_operation_failures_total", op="free", code="NOT_FOUND") == 1


def test_service_discovery_lists_registered_workers_with_metrics(metrics_url):
    client, service, url = metrics_url
    with urllib.request.urlopen(url + "/sd/workers", timeout=5) as reply:
        assert json.load(reply) == []
    stub = client.stub
    for rank, metrics_address in ((0, "127.0.0.1:9501"), (1, "")):
        stub.RegisterWorker(pb.RegisterWorkerRequest(
            address=f"127.0.0.1:{40000 + rank}", rank=rank, tensor_parallel_size=2, num_gpu_blocks=17,
            num_cpu_blocks=8, block_size=4, metrics_address=metrics_address, block_bytes=1024), timeout=5)
    with urllib.request.urlopen(url + "/sd/workers", timeout=5) as reply:
        targets = json.load(reply)
    rank0 = service.registry.workers()[0]
    assert targets == [{"targets": ["127.0.0.1:9501"],
                        "labels": {"rank": "0", "__meta_kvpager_worker_id": rank0.worker_id}}]
    st = client.get_stats()
    assert (st.workers_registered, st.workers_expected) == (2, 2)
    m = scrape(url + "/metrics")
    assert value(m, "kvpager_workers_registered") == 2 and value(m, "kvpager_workers_expected") == 2
    assert value(m, "kvpager_workers_healthy") == 2
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url + "/nothing", timeout=5)
    assert err.value.code == 404
