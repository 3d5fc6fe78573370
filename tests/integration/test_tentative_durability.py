"""Steps waiting on the workers, in the write-ahead log (issue 11): a real manager on 127.0.0.1
with --state-dir and a worker whose ExecutePlan waits until the test lets it answer. While a
copy-on-write step waits, other calls are applied and logged beside it. The state directory,
copied at three moments (as a kill -9 would leave it), recovers:

- with the step still out: the step rolled back (it was never answered), every call logged beside
  it present, invariants held;
- after the step committed, and after another one the worker failed: exactly the live state
  (block ids, free-queue and LRU order, counters), since replay reopens and finishes each
  tentative step where the log says.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from concurrent import futures

import grpc

from kvpager import errors
from kvpager.manager.config import ManagerConfig
from kvpager.manager.snapshot import manager_state
from kvpager.manager.service import BlockManagerService
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import worker_pb2, worker_pb2_grpc

from .test_durability import serving


class GatedWorker(worker_pb2_grpc.CacheWorkerServicer):
    """ExecutePlan waits for ``gate``; then answers OK, or UNAVAILABLE while ``fail`` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = False

    def ExecutePlan(self, request, context):
        self.entered.set()
        self.gate.wait(20)
        if self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the test fails this plan")
        return worker_pb2.ExecutePlanResponse(step_id=request.plan.step_id)

    def GetMemoryStats(self, request, context):
        return worker_pb2.WorkerMemoryStats()

    def open_all(self) -> None:
        self.gate.set()


@contextlib.contextmanager
def manager_with(worker: GatedWorker, config: ManagerConfig):
    """A manager on 127.0.0.1 (``serving``) with ``worker`` behind a gRPC server registered as its
    one rank; yields (client, service). Every gate is opened at the end."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_CacheWorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with serving(config) as (bm, service):
            bm.stub.RegisterWorker(pb.RegisterWorkerRequest(
                address=f"127.0.0.1:{port}", rank=0, tensor_parallel_size=1, num_gpu_blocks=64,
                num_cpu_blocks=32, block_size=4, cache_id="cache-1"), timeout=5)
            yield bm, service
    finally:
        worker.open_all()
        server.stop(None)


def recovered(state_dir: str, config: ManagerConfig) -> dict:
    """The state a manager recovers from ``state_dir`` (a copy), after its invariant check."""
    import dataclasses
    service = BlockManagerService(dataclasses.replace(config, state_dir=state_dir))
    try:
        service.manager.check_invariants()
        return without_config(manager_state(service.manager))
    finally:
        service.close()


def without_config(state: dict) -> dict:
    """The state but its configuration (which names the state directory, a copy's here)."""
    return {k: v for k, v in state.items() if k != "config"}


def live_state(service) -> dict:
    with service.state_lock:
        service.manager.check_invariants()
        return without_config(manager_state(service.manager))


def seqs(state: dict) -> dict:
    """Each sequence's length and tier (what a rolled-back step changes, without block ids)."""
    return {seq_id: (n, tier) for seq_id, _table, n, tier, *_ in state["seqs"]}


def test_steps_logged_beside_a_waiting_step_recover_at_every_moment(tmp_path):
    config = ManagerConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=32, watermark=0.0,
                           state_dir=str(tmp_path / "state"), worker_plan_timeout=20, worker_heartbeat_timeout=60)
    worker = GatedWorker()
    with manager_with(worker, config) as (bm, service):
        bm.allocate("a", token_ids=[1, 2, 3, 4, 5, 6])
        bm.fork("a", "a2")
        bm.allocate("b", token_ids=[7, 8, 9])
        bm.allocate("c", token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9])

        answered: dict = {}
        cow = threading.Thread(target=lambda: answered.update(r=bm.append("a2", token_ids=[10])))
        cow.start()                                  # a copy-on-write: waits on the worker
        assert worker.entered.wait(10)
        bm.allocate("d", token_ids=[1, 2, 3, 4, 9])  # beside it: logged after its "open" record
        bm.append("b", token_ids=[11])
        bm.free("c")
        open_copy = str(tmp_path / "while-out")
        with service.state_lock:
            assert len(service.manager.tentative) == 1
            shutil.copytree(config.state_dir, open_copy)
        worker.gate.set()
        cow.join(10)
        assert len(answered["r"].copies.src) == 1
        committed_copy = str(tmp_path / "committed")
        with service.state_lock:
            committed = live_state(service)
            shutil.copytree(config.state_dir, committed_copy)

        worker.gate.clear()
        worker.entered.clear()
        worker.fail = True
        failed: dict = {}

        def swap_out():
            try:
                bm.swap_out(["b"], request_id="")
            except Exception as err:  # noqa: BLE001 - the test checks what it was
                failed["error"] = err

        out = threading.Thread(target=swap_out)
        out.start()
        assert worker.entered.wait(10)
        bm.allocate("e", token_ids=[1, 2, 3, 4, 5, 6, 7])   # hits a's prefix, beside the swap
        worker.gate.set()
        out.join(10)
        assert isinstance(failed.get("error"), errors.Unavailable), failed
        aborted_copy = str(tmp_path / "aborted")
        with service.state_lock:
            aborted = live_state(service)
            shutil.copytree(config.state_dir, aborted_copy)
        assert seqs(aborted)["b"] == (4, "gpu")     # the failed swap-out was rolled back

    # Killed while the copy-on-write was out: it is rolled back, the rest is there.
    state = recovered(open_copy, config)
    assert seqs(state) == {"a": (6, "gpu"), "a2": (6, "gpu"), "b": (4, "gpu"), "d": (5, "gpu")}
    assert state["counters"]["cow_copies"] == 0
    # Killed after it committed, and after the failed swap-out: exactly the live state.
    assert recovered(committed_copy, config) == committed
    assert recovered(aborted_copy, config) == aborted


class TwoGateWorker(GatedWorker):
    """The first ExecutePlan waits for ``gate``, the second for ``second``."""

    def __init__(self) -> None:
        super().__init__()
        self.second = threading.Event()
        self.calls = 0
        self._lock = threading.Lock()

    def ExecutePlan(self, request, context):
        with self._lock:
            self.calls += 1
            mine = self.gate if self.calls == 1 else self.second
        self.entered.set()
        mine.wait(20)
        return worker_pb2.ExecutePlanResponse(step_id=request.plan.step_id)

    def open_all(self) -> None:
        self.gate.set()
        self.second.set()


def test_a_call_that_waited_for_a_busy_sequence_still_releases_the_lock_for_its_own_plan(tmp_path):
    """A swap-out naming the sequence of a copy-on-write that waits on the workers waits for it,
    then sends its own plan; while that plan waits, the lock is free (other calls answer)."""
    config = ManagerConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=32, watermark=0.0,
                           worker_plan_timeout=20, worker_heartbeat_timeout=60)
    worker = TwoGateWorker()
    with manager_with(worker, config) as (bm, service):
        bm.allocate("a", token_ids=[1, 2, 3, 4, 5, 6])
        bm.fork("a", "a2")
        cow = threading.Thread(target=lambda: bm.append("a2", token_ids=[10]))
        cow.start()
        assert worker.entered.wait(10)
        out = threading.Thread(target=lambda: bm.swap_out(["a2"]))   # busy: waits for the copy-on-write
        out.start()
        while service.state.waiting < 2:   # the copy-on-write's dispatch and the swap-out waiting for it
            threading.Event().wait(0.01)
        worker.gate.set()             # the copy-on-write commits; the swap-out sends its plan, which waits
        cow.join(10)
        while worker.calls < 2:
            threading.Event().wait(0.01)
        answered = threading.Event()
        threading.Thread(target=lambda: (bm.allocate("beside", token_ids=[7, 8, 9]), answered.set())).start()
        assert answered.wait(5), "the lock stayed held through the swap-out's dispatch"
        worker.second.set()
        out.join(10)
        assert bm.get_block_table("a2").tier == pb.TIER_CPU
