"""Steps waiting on the workers, in the write-ahead log (issue 11): a real manager on 127.0.0.1
with --state-dir and a worker whose ExecutePlan waits until the test lets it answer. While a
copy-on-write step waits, other calls are applied and logged beside it. The state directory,
copied at three moments (as a kill -9 would leave it), recovers:

- with the step still out: the step rolled back (it was never answered), every call logged beside
  it present, invariants held;
- after the step committed, and after another one the worker failed: exactly the live state
  (block ids, free-queue and LRU order, counters), since replay reopens and finishes each
  tentative step where the log says.

Snapshots are taken with no step out: one due while steps are out holds new block-moving calls
until they finish, so under swap traffic that keeps a step out at every commit the log that
recovery replays stays bounded (the last two tests).
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
from kvpager.manager.wal import StateDir
from kvpager.manager.service import BlockManagerService
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import worker_pb2, worker_pb2_grpc

from ..support.plan_workers import GatedWorker
from .test_durability import serving


@contextlib.contextmanager
def manager_with(worker: GatedWorker, config: ManagerConfig):
    """A manager on 127.0.0.1 (``serving``) with ``worker`` behind a gRPC server registered as its
    one rank; yields (client, service). Every gate is opened at the end."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_CacheWorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        worker.port = port
        with serving(config) as (bm, service):
            register(bm, port)
            yield bm, service
    finally:
        worker.open_all()
        server.stop(None)


def register(bm, port: int) -> None:
    """Register the worker serving on ``port`` as rank 0 (again: its cache is intact)."""
    bm.stub.RegisterWorker(pb.RegisterWorkerRequest(
        address=f"127.0.0.1:{port}", rank=0, tensor_parallel_size=1, num_gpu_blocks=64,
        num_cpu_blocks=32, block_size=4, cache_id="cache-1"), timeout=5)


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
    worker = GatedWorker(hold=20)
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


class RelayWorker(GatedWorker):
    """Answers each ExecutePlan once the next plan has arrived, or after ``linger`` seconds
    without one: under steady swap traffic some step is always out with it. Fails (UNAVAILABLE)
    the plans whose arrival number is in ``fail_at``."""

    def __init__(self, linger: float, fail_at: frozenset[int]) -> None:
        super().__init__()
        self.linger = linger
        self.fail_at = fail_at
        self.arrived = 0
        self._cond = threading.Condition()

    def ExecutePlan(self, request, context):
        with self._cond:
            self.arrived += 1
            mine = self.arrived
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.arrived > mine or self.gate.is_set(), timeout=self.linger)
        if mine in self.fail_at:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the test fails this plan")
        return worker_pb2.ExecutePlanResponse(step_id=request.plan.step_id)


def test_snapshots_are_taken_and_the_log_stays_bounded_while_steps_are_always_out(tmp_path):
    """Two clients swap their sequences out and in without pause (with allocations and frees
    beside them) against a worker that holds each plan until the next one arrives, so some step
    is tentative at every commit; some plans fail (rolled back). Snapshots are still taken every
    ``snapshot_records`` records or so (the manager holds new block-moving steps until the open
    ones finish), so what recovery replays stays bounded; a copy of the state directory taken
    while a step is out recovers (that step rolled back), and the final one is the live state."""
    records = 8
    # What may be logged after the snapshot falls due and before it is taken: the finish records of
    # the (up to two) steps open then, an allocation and a free beside them, a worker registering again.
    slack = 5
    config = ManagerConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=32, watermark=0.0, fsync="never",
                           state_dir=str(tmp_path / "state"), worker_plan_timeout=20, worker_heartbeat_timeout=60)
    worker = RelayWorker(linger=0.3, fail_at=frozenset({9, 23, 37}))
    with manager_with(worker, config) as (bm, service):
        durable = service.durable
        durable.dir.snapshot_records = records
        started_with = durable.dir.snapshots
        seen = {"records": 0, "open_at_commit": 0, "samples": 0}
        mid_copy: dict = {}

        def traffic(name: str, rounds: int) -> None:
            bm.allocate(name, token_ids=[1, 2, 3, 4, 5, 6])
            on_gpu = True
            for i in range(rounds):
                try:
                    (bm.swap_out if on_gpu else bm.swap_in)([name], request_id="")
                    on_gpu = not on_gpu
                except errors.Unavailable:   # the worker failed this plan (rolled back) and was dropped
                    register(bm, worker.port)
                bm.allocate(f"{name}-x{i}", token_ids=[7, 8, 9])
                bm.free(f"{name}-x{i}")
                with service.state_lock:
                    seen["records"] = max(seen["records"], durable.dir.records)
                    seen["samples"] += 1
                    seen["open_at_commit"] += bool(service.manager.tentative)
                    if name == "a" and i == rounds // 2:
                        mid_copy["path"] = str(tmp_path / "mid")
                        mid_copy["open"] = {s for st in service.manager.tentative.steps.values() for s in st.ids}
                        service.manager.check_invariants()
                        mid_copy["live"] = {q.seq_id: (q.num_tokens, q.tier) for q in service.manager.seqs.values()}
                        shutil.copytree(config.state_dir, mid_copy["path"])

        threads = [threading.Thread(target=traffic, args=(name, 24)) for name in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        total = durable.dir.records_total
        assert worker.arrived >= 40 and seen["open_at_commit"] > seen["samples"] // 2, (worker.arrived, seen)
        assert total > 10 * records
        # Snapshots kept pace with the log: what a recovery replays is bounded.
        assert durable.dir.snapshots - started_with >= total // (records + slack) - 1, (
            durable.dir.snapshots - started_with, total, seen)
        assert seen["records"] <= records + slack, seen
        worker.open_all()
        final_copy = str(tmp_path / "final")
        with service.state_lock:
            assert not service.manager.tentative
            final = live_state(service)
            shutil.copytree(config.state_dir, final_copy)

    state_dir = StateDir(mid_copy["path"])
    replayed = len(state_dir.load()[1])
    state_dir.close()
    assert 0 < replayed <= records + slack
    mid = recovered(mid_copy["path"], config)   # the step that was out is rolled back
    assert mid_copy["open"]
    assert ({k: v for k, v in seqs(mid).items() if k not in mid_copy["open"]}
            == {k: v for k, v in mid_copy["live"].items() if k not in mid_copy["open"]})
    assert recovered(final_copy, config) == final


def running_seqs(service) -> dict:
    """Each sequence's length and tier, read under the lock while a step may be out (a whole
    ``manager_state`` is only taken with none)."""
    with service.state_lock:
        service.manager.check_invariants()
        return {q.seq_id: (q.num_tokens, q.tier) for q in service.manager.seqs.values()}


def test_a_snapshot_due_while_a_step_is_out_is_taken_when_it_finishes(tmp_path):
    """A snapshot falls due while a swap-out waits on the worker: it is not taken yet; a call that
    may move blocks waits (nothing applied), one that cannot is answered; when the step commits,
    or the worker fails it and it is rolled back, the snapshot is taken and the waiting call goes
    on. A copy of the state directory at each moment recovers: while the step is out, with it
    rolled back; after, exactly the live state."""
    config = ManagerConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=32, watermark=0.0, fsync="never",
                           state_dir=str(tmp_path / "state"), worker_plan_timeout=20, worker_heartbeat_timeout=60)
    worker = GatedWorker(hold=20)
    with manager_with(worker, config) as (bm, service):
        durable = service.durable
        durable.dir.snapshot_records = 4
        for round_, ok in enumerate((True, False)):
            out, held = f"out{round_}", f"held{round_}"
            bm.allocate(out, token_ids=[1, 2, 3, 4, 5, 6])
            bm.allocate(held, token_ids=[7, 8, 9])
            worker.gate.clear()
            worker.entered.clear()
            worker.fail = not ok
            errors_seen: dict = {}

            def swap(seq_id: str) -> None:
                try:
                    bm.swap_out([seq_id], request_id="")
                except errors.Unavailable as err:
                    errors_seen[seq_id] = err

            first = threading.Thread(target=swap, args=(out,))
            second = threading.Thread(target=swap, args=(held,))
            first.start()
            try:
                assert worker.entered.wait(10)
                taken = durable.dir.snapshots
                for i in range(4):                          # beside it, until a snapshot is due
                    bm.allocate(f"beside{round_}-{i}", token_ids=[i])
                assert durable.dir.due() and durable.dir.snapshots == taken
                second.start()
                while service.state.waiting < 2:            # the swap-out's dispatch, and the held call
                    threading.Event().wait(0.01)
                bm.free(f"beside{round_}-0")                # cannot move blocks: answered meanwhile
                assert durable.dir.snapshots == taken and running_seqs(service)[held] == (3, "gpu")
                while_out = str(tmp_path / f"while-out-{round_}")
                with service.state_lock:
                    before = running_seqs(service)
                    shutil.copytree(config.state_dir, while_out)
            finally:   # no call left running when the manager closes its log
                worker.gate.set()
                for t in (first, second):
                    if t.ident is not None:   # started
                        t.join(10)
            assert durable.dir.snapshots > taken
            assert (out in errors_seen) == (not ok)
            if not ok:   # the worker was dropped with the failed plan; the held swap-out found none
                register(bm, worker.port)
                assert seqs(live_state(service))[out] == (6, "gpu")
            after = str(tmp_path / f"after-{round_}")
            with service.state_lock:
                live = live_state(service)
                shutil.copytree(config.state_dir, after)
            assert recovered(after, config) == live
            state = recovered(while_out, config)       # the swap-out that was out is rolled back
            assert seqs(state) == {**before, out: (6, "gpu")}
