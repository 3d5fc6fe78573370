"""Stopping ``kvpager manager`` (--state-dir) while calls still run: a real manager process and a
worker whose ExecutePlan holds its answer. SIGTERM with a short --grace: gRPC cancels the calls
still running after it, but their threads run on; the step whose plan is out is rolled back (its
ExecutePlan cancelled, so a stuck worker does not hold the exit), the call waiting for its
sequence is refused, and the log is closed only after that. The process exits 0 (it exited 75,
"log write failed", when those calls wrote to the closed log), and a restart recovers the state
as it was before the cancelled calls: none of them was answered.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent import futures

import grpc

from kvpager import client as C
from kvpager.manager.wal import EXIT_LOG_FAILED
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import worker_pb2_grpc

from ..support.plan_workers import GatedWorker
from .test_durability import start_manager


def _register(bm: C.BlockManagerClient, port: int) -> None:
    """The worker on ``port`` as the group's one rank, with the pools of test_durability's FLAGS."""
    bm.stub.RegisterWorker(pb.RegisterWorkerRequest(
        address=f"127.0.0.1:{port}", rank=0, tensor_parallel_size=1, num_gpu_blocks=96, num_cpu_blocks=48,
        block_size=4, cache_id="cache-1"), timeout=5)


def _state(bm: C.BlockManagerClient) -> tuple:
    """What the sequences hold, and the free blocks."""
    tables = tuple((s, tuple(t.block_ids), t.num_tokens) for s in ("a", "a2")
                   for t in [bm.get_block_table(s)])
    stats = bm.get_stats()
    return tables, stats.gpu.free_blocks, stats.cpu.free_blocks


def test_sigterm_while_a_step_waits_on_a_worker_stops_cleanly_and_recovers_exactly(tmp_path):
    state_dir, log_path = str(tmp_path / "state"), str(tmp_path / "manager.log")
    worker = GatedWorker(hold=20)   # holds ExecutePlan up to 20 s: longer than the test waits for the exit
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_CacheWorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proc, target = start_manager(state_dir, log_path, "--grace", "0.5", "--worker-plan-timeout", "30",
                                 "--worker-heartbeat-timeout", "60")
    try:
        with C.BlockManagerClient(target, retries=0) as bm:
            _register(bm, port)
            bm.allocate("a", token_ids=[1, 2, 3, 4, 5, 6])
            bm.fork("a", "a2")
            before = _state(bm)
            outcomes: dict[str, object] = {}

            def call(name, fn):
                try:
                    outcomes[name] = fn()
                except Exception as err:  # noqa: BLE001 - the test checks what it was
                    outcomes[name] = err

            cow = threading.Thread(target=call, args=("append", lambda: bm.append("a2", token_ids=[7])))
            cow.start()                         # a copy-on-write of a2's shared block: waits on the worker
            assert worker.entered.wait(10)
            free = threading.Thread(target=call, args=("free", lambda: bm.free("a2")))
            free.start()                        # waits for the append's step (a2 is busy)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            code = proc.wait(timeout=15)
            took = time.monotonic() - started
            cow.join(10)
            free.join(10)
        with open(log_path) as f:
            log = f.read()
        assert code == 0, f"exit status {code} ({EXIT_LOG_FAILED}: log write failed)\n{log[-3000:]}"
        assert took < 10, took                  # not held by the worker (it holds 20 s, the plan timeout is 30)
        assert "cannot write the state log" not in log and "not logged" not in log, log[-3000:]
        # Neither call was answered (gRPC cancelled them after the grace period) ...
        assert all(isinstance(o, Exception) for o in outcomes.values()), outcomes
    finally:
        worker.open_all()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # ... and neither is in the recovered state: the append rolled back, the free refused.
    proc, target = start_manager(state_dir, log_path)
    try:
        with C.BlockManagerClient(target) as bm:
            assert _state(bm) == before
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        server.stop(None)
