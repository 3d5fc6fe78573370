"""Durable state (--state-dir): kill -9 of a real manager process under a mutating load, again and
again; after each restart every acknowledged operation is there, the one whose answer was lost
is either fully applied or not at all (and its retry with the same request id answers the first
answer), invariants hold, and the state equals a replay of the acknowledged operations on an
in-process reference BlockManager. Also: a torn last log record is dropped; a corrupt record
before the last refuses to start with a clear message. CPU only, no workers.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from kvpager import client as C
from kvpager.manager import wire
from kvpager.manager.block_manager import BlockManager
from kvpager.manager.config import ManagerConfig
from kvpager.errors import ManagerError, NotFound, Unavailable
from kvpager.status import status_of
from kvpager.manager.snapshot import manager_state, restore_manager
from kvpager.manager.wal import CorruptState, StateDir
from kvpager.v1 import block_manager_pb2 as pb

POOL = dict(block_size=4, num_gpu_blocks=96, num_cpu_blocks=48)
FLAGS = ["--block-size", "4", "--num-gpu-blocks", "96", "--num-cpu-blocks", "48"]
KILLS = 22
SERVICE = "kvpager.v1.BlockManager"


def start_manager(state_dir: str, log_path: str, *extra: str) -> tuple[subprocess.Popen, str]:
    with open(log_path, "a") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpager", "manager", "--insecure", "--port", "0", "--state-dir", state_dir,
             *FLAGS, *extra],
            stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if not match:
        proc.kill()
        proc.wait()
        with open(log_path) as f:
            raise AssertionError(f"manager did not start: {line!r}\n{f.read()[-3000:]}")
    return proc, match.group(1)


# ---- the load: requests, and the reference that applies the acknowledged ones --------------------
class Load:
    """Random mutating requests; each acknowledged one is applied to ``ref`` in the same order."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ref = BlockManager(ManagerConfig(**POOL))
        self.n = 0
        self.prompts = [[self.rng.randrange(50) for _ in range(12)] for _ in range(3)]  # shared prefixes

    def _live(self, tier=None) -> list[str]:
        return [s.seq_id for s in self.ref.seqs.values() if tier is None or s.tier == tier]

    def _new_id(self) -> str:
        self.n += 1
        return f"s{self.n}"

    def _prompt(self) -> list[int]:
        rng = self.rng
        base = rng.choice(self.prompts)[:rng.randrange(1, 13)] if rng.random() < 0.5 else []
        return base + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]

    def _pb_op(self, running: list[str], live: list[str]) -> pb.Operation:
        rng = self.rng
        r = rng.random()
        if r < 0.25 or not live:
            return C.allocate_op(self._new_id(), token_ids=self._prompt())
        if r < 0.55 and running:
            ids = rng.sample(running, min(len(running), rng.randrange(1, 6)))
            return C.append_batch_op(ids, [rng.randrange(50) for _ in ids])
        if r < 0.7 and running:
            return C.fork_op(rng.choice(running), self._new_id())
        if r < 0.9:
            return C.free_op(rng.choice(live))
        return C.append_op(rng.choice(live), token_ids=[rng.randrange(50) for _ in range(rng.randrange(1, 6))])

    def next(self) -> tuple[str, object]:
        """(method, request) of the next call."""
        rng = self.rng
        live, running = self._live(), self._live("gpu")
        if len(live) > 30:  # keep the pool busy but not full
            return "Free", pb.FreeRequest(seq_id=rng.choice(live))
        r = rng.random()
        if r < 0.2 or not live:
            return "Allocate", pb.AllocateRequest(seq_id=self._new_id(), token_ids=self._prompt())
        if r < 0.35:
            return "Append", pb.AppendRequest(seq_id=rng.choice(live), token_ids=[rng.randrange(50)])
        if r < 0.45 and running:
            return "Fork", pb.ForkRequest(parent_seq_id=rng.choice(running), child_seq_id=self._new_id())
        if r < 0.55:
            return "Free", pb.FreeRequest(seq_id=rng.choice(live))
        if r < 0.6 and running:
            return "SwapOut", pb.SwapOutRequest(seq_ids=[rng.choice(running)])
        swapped = self._live("cpu")
        if r < 0.65 and swapped:
            return "SwapIn", pb.SwapInRequest(seq_ids=[rng.choice(swapped)])
        ops = [self._pb_op(running, live) for _ in range(rng.randrange(1, 5))]
        return "Step", pb.StepRequest(operations=ops, all_or_nothing=rng.random() < 0.3)


_SINGLE = {"Allocate": wire.allocate_op, "Append": wire.append_op, "Fork": wire.fork_op, "Free": wire.free_op,
           "SwapOut": wire.swap_out_op, "SwapIn": wire.swap_in_op}


def apply_ref(m: BlockManager, method: str, request) -> tuple:
    """Apply a request to the reference as the service does; its outcome: (step id, codes)."""
    if method == "Step":
        result = m.step(wire.step_ops(request), request.all_or_nothing, layout=wire.step_layout(request))
        return result.step_id, [None if o.error is None else status_of(o.error) for o in result.outcomes]
    try:
        m.run(_SINGLE[method](request))
        return m.steps, [None]
    except ManagerError as err:
        return m.steps, [status_of(err)]


def call(bm: C.BlockManagerClient, method: str, request, request_id: str) -> tuple:
    """Send a request; its outcome as apply_ref gives it (the step id only for Step)."""
    send = {"Allocate": bm.stub.Allocate, "Append": bm.stub.Append, "Fork": bm.stub.Fork, "Free": bm.stub.Free,
            "SwapOut": bm.stub.SwapOut, "SwapIn": bm.stub.SwapIn, "Step": bm.stub.Step}[method]
    try:
        reply = bm._mutate(send, getattr(pb, f"{method}Response"), request, request_id)
    except Unavailable:
        raise
    except ManagerError as err:
        return None, [err.code]
    if method == "Step":
        return reply.step_id, [None if (e := C.result_error(r)) is None else e.code for r in reply.results]
    return None, [None]


def same(got: tuple, want: tuple) -> bool:
    return got[1] == want[1] and (got[0] is None or got[0] == want[0])


def signature(bm: C.BlockManagerClient, seq_ids) -> tuple:
    """What the server holds: the named sequences' tables, and its counters."""
    tables = {}
    for seq_id in sorted(seq_ids):
        try:
            t = bm.get_block_table(seq_id)
            tables[seq_id] = ("gpu" if t.tier == pb.TIER_GPU else "cpu", t.num_tokens, tuple(t.block_ids))
        except NotFound:
            tables[seq_id] = None
    s = bm.get_stats()
    return tables, _stats(s)


def _stats(s) -> tuple:
    return (s.gpu.used_blocks, s.gpu.free_blocks, s.gpu.cached_blocks, s.cpu.used_blocks, s.cpu.free_blocks,
            s.running_sequences, s.swapped_sequences, s.steps, s.prefix_hit_tokens, s.cow_copies, s.preemptions,
            s.evictions)


def expected(m: BlockManager, seq_ids) -> tuple:
    tables = {}
    for seq_id in sorted(seq_ids):
        s = m.seqs.get(seq_id)
        tables[seq_id] = None if s is None else (s.tier, s.num_tokens, tuple(s.block_ids))
    return tables, _stats(wire.stats_pb(m.stats()))


def clone(m: BlockManager) -> BlockManager:
    return restore_manager(manager_state(m), m.config)


# ---- the test --------------------------------------------------------------------------------
def test_kill_9_under_load_loses_nothing_acknowledged(tmp_path):
    state_dir, log_path = str(tmp_path / "state"), str(tmp_path / "manager.log")
    load = Load(seed=11)
    up = threading.Event()          # a manager incarnation is serving at target[0]
    verified = threading.Event()    # the load checked the incarnation and is running on it
    done = threading.Event()
    target: list[str] = [""]
    report = {"acked": 0, "in_doubt": 0, "applied_before_kill": 0, "errors": []}

    def worker():
        in_doubt = None  # (method, request, request_id) whose answer was lost
        while not done.is_set():
            if not up.wait(0.1):
                continue
            with C.BlockManagerClient(target[0], timeout=5.0, retries=2, retry_backoff=0.02) as bm:
                try:
                    if in_doubt is not None:
                        method, request, rid = in_doubt
                        ids = set(load.ref.seqs._seqs) | _named(request)
                        after = clone(load.ref)
                        want = apply_ref(after, method, request)
                        now = signature(bm, ids)
                        if now == expected(load.ref, ids):
                            state = "not applied"
                        elif now == expected(after, ids):
                            state = "applied"
                            report["applied_before_kill"] += 1
                        else:
                            raise AssertionError(f"{method} {request} half-applied after a kill:\n{now}\n"
                                                 f"not applied: {expected(load.ref, ids)}\napplied: {expected(after, ids)}")
                        got = call(bm, method, request, rid)  # the retry: the first answer, or applied now
                        assert same(got, want), (method, state, got, want)
                        assert signature(bm, ids) == expected(after, ids), f"retry of {method} ({state}) applied twice?"
                        load.ref = after
                        in_doubt = None
                    ids = set(load.ref.seqs._seqs)
                    assert signature(bm, ids) == expected(load.ref, ids), "state after restart != acknowledged"
                    verified.set()
                    while not done.is_set():
                        method, request = load.next()
                        rid = uuid.uuid4().hex
                        in_doubt = (method, request, rid)
                        got = call(bm, method, request, rid)
                        want = apply_ref(load.ref, method, request)
                        in_doubt = None
                        report["acked"] += 1
                        assert same(got, want), (method, request, got, want)
                except Unavailable:
                    if in_doubt is not None:
                        report["in_doubt"] += 1
                    up.clear()
                except BaseException as exc:  # reported by the main thread
                    report["errors"].append(exc)
                    done.set()
                    verified.set()
                    return

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    rng = random.Random(5)
    started = time.monotonic()
    proc = None
    try:
        for i in range(KILLS + 1):
            proc, target[0] = start_manager(state_dir, log_path)
            verified.clear()
            up.set()
            assert verified.wait(30), "the load did not resume after a restart"
            assert not report["errors"], report["errors"][0]
            if i == KILLS:
                break
            time.sleep(rng.uniform(0.02, 0.4))  # under load
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            assert time.monotonic() - started < 150, "too slow"
        time.sleep(0.2)
        done.set()
        thread.join(30)
        assert not report["errors"], report["errors"][0]
        # The last incarnation: stop it gracefully, recover once more, check the whole state.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        proc, target[0] = start_manager(state_dir, log_path)
        with C.BlockManagerClient(target[0]) as bm:
            ids = set(load.ref.seqs._seqs)
            assert signature(bm, ids) == expected(load.ref, ids)
    finally:
        done.set()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    print("durability load:", {k: v for k, v in report.items() if k != "errors"})
    assert report["acked"] > 200, report
    assert report["in_doubt"] >= 1, report
    with open(log_path) as f:
        text = f.read()
    assert text.count("recovered") >= KILLS, "each restart recovers"


def _named(request) -> set[str]:
    """The sequence ids a request names."""
    names = set()
    for field in ("seq_id", "parent_seq_id", "child_seq_id"):
        if getattr(request, field, ""):
            names.add(getattr(request, field))
    names.update(getattr(request, "seq_ids", []))
    for op in getattr(request, "operations", []):
        names |= _named(getattr(op, op.WhichOneof("op")))
    return names


# ---- torn and corrupt logs -------------------------------------------------------------------------
def _fill(state_dir: str, n: int = 5) -> None:
    sd = StateDir(state_dir, "never")
    sd.load()
    for i in range(n):
        sd.append({"changes": [], "requests": [], "i": i})
    sd.close()


def _segment(state_dir: str) -> str:
    names = sorted(f for f in os.listdir(state_dir) if f.startswith("wal."))
    return os.path.join(state_dir, names[-1])


@pytest.mark.parametrize("cut", [1, 5, 9, 20])
def test_torn_last_record_is_dropped(tmp_path, cut):
    d = str(tmp_path)
    _fill(d)
    path = _segment(d)
    size = os.path.getsize(path)
    last = size - _last_record_len(path)
    with open(path, "r+b") as f:
        f.truncate(last + min(cut, size - last - 1))  # cut inside the last record
    sd = StateDir(d)
    _, records = sd.load()
    sd.close()
    assert [r["i"] for r in records] == [0, 1, 2, 3]
    assert os.path.getsize(path) == last  # truncated to the last good record
    sd = StateDir(d)  # and appending continues after it
    assert [r["i"] for r in sd.load()[1]] == [0, 1, 2, 3]
    sd.append({"changes": [], "requests": [], "i": 9})
    sd.close()
    sd = StateDir(d)
    assert [r["i"] for r in sd.load()[1]] == [0, 1, 2, 3, 9]
    sd.close()


def test_corrupt_last_record_and_zero_tail_are_dropped(tmp_path):
    d = str(tmp_path)
    _fill(d)
    path = _segment(d)
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")  # bad CRC on the last record
    with open(path, "ab") as f:
        f.write(bytes(4096))       # and zeros after it (a file extended but never written)
    sd = StateDir(d)
    assert [r["i"] for r in sd.load()[1]] == [0, 1, 2, 3]
    sd.close()


def _last_record_len(path: str) -> int:
    import struct
    data = open(path, "rb").read()
    pos, last = 0, 0
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        last = 8 + length
        pos += last
    return last


def test_corrupt_middle_record_refuses_to_start(tmp_path):
    d = str(tmp_path / "state")
    proc, target = start_manager(d, str(tmp_path / "m.log"))
    with C.BlockManagerClient(target) as bm:
        for i in range(5):
            bm.allocate(f"a{i}", token_ids=[1, 2, 3, i])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    path = _segment(d)
    with open(path, "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0x40]))  # one flipped bit inside the first record
    sd = StateDir(d)
    with pytest.raises(CorruptState, match="corrupt before its last record"):
        sd.load()
    sd.close()
    out = subprocess.run([sys.executable, "-m", "kvpager", "manager", "--insecure", "--port", "0", "--state-dir", d,
                          *FLAGS], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "cannot recover the manager's state" in out.stderr and "corrupt before its last record" in out.stderr, \
        out.stderr[-2000:]
    assert "listening" not in out.stdout


@pytest.mark.parametrize("byte", [2, 3])   # the length's high bytes: it then points past the file's end
def test_a_middle_record_with_a_damaged_length_refuses_to_start(tmp_path, byte):
    d = str(tmp_path)
    _fill(d)
    path = _segment(d)
    second = _last_record_len(path)  # every record of _fill has the same size
    with open(path, "r+b") as f:
        f.seek(second + byte)
        old = f.read(1)
        f.seek(second + byte)
        f.write(bytes([old[0] ^ 0x10]))
    sd = StateDir(d)
    with pytest.raises(CorruptState, match=f"yet a good record starts at offset {2 * second}"):
        sd.load()
    sd.close()


def test_a_snapshot_cut_short_in_its_header_refuses_to_start(tmp_path):
    from kvpager.manager.wal import MAGIC

    (tmp_path / "snapshot").write_bytes(MAGIC + b"\x01")
    sd = StateDir(str(tmp_path))
    with pytest.raises(CorruptState, match="not a kvpager snapshot"):
        sd.load()
    sd.close()


def test_a_record_above_the_limit_is_refused_not_written(tmp_path, monkeypatch):
    from kvpager.manager import wal

    d = str(tmp_path)
    _fill(d, 2)
    monkeypatch.setattr(wal, "MAX_RECORD", 64)
    sd = StateDir(d, "never")
    sd.load()
    with pytest.raises(OSError, match="above the 64-byte limit"):
        sd.append({"changes": [], "requests": [], "pad": bytes(100)})
    sd.close()
    monkeypatch.undo()
    sd = StateDir(d)
    assert [r["i"] for r in sd.load()[1]] == [0, 1]
    sd.close()


def test_a_snapshot_that_cannot_open_the_next_segment_leaves_the_log_in_use(tmp_path, monkeypatch):
    """A snapshot failing before its rename keeps the old snapshot and segment: the calls logged
    after it are recovered, and the failure is not the call's (it is answered, the snapshot is
    tried again later)."""
    from kvpager.manager import wal

    d = str(tmp_path / "state")
    config = ManagerConfig(**POOL, state_dir=d, fsync="never")
    real_open = os.open

    def no_next_segment(path, *args, **kwargs):
        if os.path.basename(path) == "wal.00000002":
            raise OSError(24, "Too many open files")
        return real_open(path, *args, **kwargs)

    with serving(config) as (bm, svc):
        svc.durable.dir.snapshot_records = 2
        monkeypatch.setattr(wal.os, "open", no_next_segment)
        bm.allocate("a", token_ids=[1, 2, 3])
        bm.allocate("b", token_ids=[4, 5, 6])    # the snapshot is due here and fails
        bm.allocate("c", token_ids=[7, 8, 9])    # not tried again yet
        assert svc.durable.dir.snapshots == 1     # the one written at start
        monkeypatch.undo()
        state = manager_state(svc.manager)
    with serving(config) as (bm, svc):
        assert manager_state(svc.manager) == state
        assert sorted(seq.seq_id for seq in svc.manager.seqs.values()) == ["a", "b", "c"]


def test_prefix_caching_must_stay_as_the_state_was_written(tmp_path):
    d = str(tmp_path / "state")
    with serving(ManagerConfig(**POOL, state_dir=d, fsync="never")) as (bm, _):
        bm.allocate("a", token_ids=list(range(9)))
    from kvpager.manager.service import create_server

    with pytest.raises(CorruptState, match="written with prefix caching on; the flags say off"):
        create_server(ManagerConfig(**POOL, state_dir=d, fsync="never", enable_prefix_caching=False))


def test_a_failed_batch_fsync_stops_the_process(tmp_path):
    """--fsync batch: the flusher's fdatasync failing ends the process with status 75, as a
    failed write does (what was answered since the last fsync may not be durable)."""
    code = f"""
import os, time
from kvpager.manager.wal import StateDir
sd = StateDir({str(tmp_path)!r}, "batch")
sd.load()
def broken(fd):
    raise OSError(5, "Input/output error")
os.fdatasync = broken
sd.append({{"changes": [], "requests": []}})
time.sleep(5)
print("still running")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 75, (out.returncode, out.stdout, out.stderr[-2000:])
    assert "cannot fsync the state log" in out.stderr and "still running" not in out.stdout


def test_a_waiting_steps_open_record_is_fsynced_before_its_plan_leaves(tmp_path, monkeypatch):
    """--fsync always: the record of a step that waits on the workers reaches the disk before
    its plan reaches a worker (a power loss must not let a restarted manager reuse its step id)."""
    from concurrent import futures

    import grpc

    from kvpager.v1 import worker_pb2, worker_pb2_grpc

    events: list[str] = []

    class Worker(worker_pb2_grpc.CacheWorkerServicer):
        def ExecutePlan(self, request, context):
            events.append("plan")
            return worker_pb2.ExecutePlanResponse(step_id=request.plan.step_id)

    worker = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_CacheWorkerServicer_to_server(Worker(), worker)
    worker_port = worker.add_insecure_port("127.0.0.1:0")
    worker.start()
    real_fdatasync = os.fdatasync

    def fdatasync(fd):
        events.append("fsync")
        real_fdatasync(fd)

    try:
        with serving(ManagerConfig(**POOL, state_dir=str(tmp_path / "state"), fsync="always")) as (bm, _):
            bm.stub.RegisterWorker(pb.RegisterWorkerRequest(
                address=f"127.0.0.1:{worker_port}", rank=0, tensor_parallel_size=1, num_gpu_blocks=96,
                num_cpu_blocks=48, block_size=4, cache_id="c0"), timeout=5)
            bm.allocate("v", num_tokens=6)
            monkeypatch.setattr(os, "fdatasync", fdatasync)
            bm.swap_out(["v"])
            monkeypatch.undo()
    finally:
        worker.stop(None)
    assert events[:2] == ["fsync", "plan"] and events.count("fsync") == 2, events   # then the finish record


def test_a_rolled_back_steps_operations_are_counted_after_a_restart(tmp_path):
    """A step rolled back after it ran (its answer over max_reply_bytes) counts its operations
    failed; a restarted manager counts them the same (the log notes them with its step id)."""
    from kvpager.errors import OutOfRange

    config = ManagerConfig(block_size=1, num_gpu_blocks=4096, num_cpu_blocks=16, max_reply_bytes=1024,
                           state_dir=str(tmp_path / "state"), fsync="never")
    with serving(config) as (bm, svc):
        bm.allocate("a", num_tokens=150)
        bm.fork("a", "b")
        bm.fork("a", "c")
        with pytest.raises(OutOfRange):
            bm.step([C.append_batch_op(["a", "b", "c"], [1, 1, 1])])   # the answer's tables exceed 1 KiB
        live = manager_state(svc.manager)
    assert any(code == "OUT_OF_RANGE" for _, code in svc.manager.op_counts.failed)
    with serving(config) as (_, svc):
        assert manager_state(svc.manager) == live


def test_restart_keeps_acknowledged_state_and_request_answers(tmp_path):
    """Snapshots every few records, then recovery from snapshot + log; a retried request after the
    restart gets its first answer; the pool sizes of the state win over a mismatch (refused)."""
    d = str(tmp_path / "state")
    proc, target = start_manager(d, str(tmp_path / "m.log"))
    try:
        with C.BlockManagerClient(target) as bm:
            first = bm.allocate("a", token_ids=list(range(9)), request_id="r1")
            bm.fork("a", "b")
            step = bm.step([C.append_batch_op(["a", "b"], [7, 8])], request_id="r2")
            before = signature(bm, {"a", "b"})
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc, target = start_manager(d, str(tmp_path / "m.log"))
    try:
        with C.BlockManagerClient(target) as bm:
            assert signature(bm, {"a", "b"}) == before
            assert bm.allocate("a", token_ids=list(range(9)), request_id="r1") == first
            assert bm.step([C.append_batch_op(["a", "b"], [7, 8])], request_id="r2") == step
            assert signature(bm, {"a", "b"}) == before  # the retries applied nothing
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    out = subprocess.run([sys.executable, "-m", "kvpager", "manager", "--insecure", "--port", "0", "--state-dir", d,
                          "--num-gpu-blocks", "64", "--block-size", "4", "--num-cpu-blocks", "48"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "pools of 96 GPU / 48 CPU blocks" in out.stderr, out.stderr[-2000:]


def test_snapshots_rotate_the_log_and_recover(tmp_path):
    """In process: a snapshot every few records; recovery = snapshot + the log after it."""
    from kvpager.manager.service import create_server

    d = str(tmp_path / "state")
    config = ManagerConfig(**POOL, state_dir=d, fsync="never")
    server, port, svc, _ = create_server(config)
    svc.durable.dir.snapshot_records = 7
    server.start()
    load = Load(seed=3)
    try:
        with C.BlockManagerClient(f"127.0.0.1:{port}") as bm:
            for i in range(60):
                method, request = load.next()
                assert same(call(bm, method, request, f"q{i}"), apply_ref(load.ref, method, request))
        assert svc.durable.dir.snapshots >= 8
        state = manager_state(svc.manager)
    finally:
        server.stop(0).wait()
        svc.close()
    assert len([f for f in os.listdir(d) if f.startswith("wal.")]) == 1
    server, port, svc, _ = create_server(config)
    try:
        assert manager_state(svc.manager) == state == manager_state(load.ref) | {"config": state["config"]}
        svc.manager.check_invariants()
    finally:
        svc.close()


@contextlib.contextmanager
def serving(config: ManagerConfig):
    """An in-process manager server on 127.0.0.1 with a client: yields (client, service); stops
    both and closes the state directory after."""
    from kvpager.manager.service import create_server

    server, port, svc, _ = create_server(config)
    server.start()
    try:
        with C.BlockManagerClient(f"127.0.0.1:{port}") as bm:
            yield bm, svc
    finally:
        server.stop(0).wait()
        svc.close()


def test_pools_sized_by_workers_keep_their_sizes(tmp_path):
    """--num-gpu-blocks 0: the pools the workers sized are recovered before any worker registers
    again; a worker with less capacity than them is refused FAILED_PRECONDITION."""
    import grpc

    d = str(tmp_path / "state")
    config = ManagerConfig(block_size=4, num_gpu_blocks=0, state_dir=d, worker_heartbeat_timeout=60)

    def register(stub, gpu, cpu):
        return stub.RegisterWorker(pb.RegisterWorkerRequest(
            address="127.0.0.1:1", rank=0, tensor_parallel_size=1, num_gpu_blocks=gpu, num_cpu_blocks=cpu,
            block_size=4, block_bytes=1024))

    with serving(config) as (bm, svc):
        assert register(bm.stub, 64, 32).num_gpu_blocks == 64
        bm.allocate("a", token_ids=list(range(10)))
        table = bm.get_block_table("a")
    with serving(config) as (bm, svc):
        assert (svc.manager.gpu.num_blocks, svc.manager.cpu.num_blocks) == (64, 32)
        assert bm.get_block_table("a") == table
        # The process serves; steps that move blocks wait for the workers holding the state.
        assert bm.health() == "SERVING" and bm.health(SERVICE) == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as err:
            register(bm.stub, 48, 32)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert bm.health(SERVICE) == "NOT_SERVING"
        assert register(bm.stub, 64, 32).num_gpu_blocks == 64
        assert bm.health(SERVICE) == "SERVING"
        bm.append("a", token_ids=[1])
        svc.manager.check_invariants()


def register_rank(stub, cache_id: str, rank: int = 0):
    """Rank ``rank`` of a group of 2 registers with cache ``cache_id`` (POOL's capacity)."""
    return stub.RegisterWorker(pb.RegisterWorkerRequest(
        address="127.0.0.1:1", rank=rank, tensor_parallel_size=2, num_gpu_blocks=96, num_cpu_blocks=48,
        block_size=4, block_bytes=1024, cache_id=cache_id))


def test_a_rank_replaced_after_state_was_made_in_the_new_epoch_starts_another(tmp_path):
    """Rank 0 is replaced (epoch 1), a sequence is made on the group, then rank 1 is replaced too:
    that sequence's K/V was in rank 1's old cache, so a second epoch begins and it is lost."""
    from kvpager.errors import DataLoss

    config = ManagerConfig(**POOL, state_dir=str(tmp_path / "state"), worker_heartbeat_timeout=60)

    with serving(config) as (bm, svc):
        register_rank(bm.stub, "A0", 0)
        register_rank(bm.stub, "A1", 1)
        register_rank(bm.stub, "B0", 0)
        assert bm.get_stats().epoch == 1
        bm.allocate("x", token_ids=list(range(12)))
        register_rank(bm.stub, "B1", 1)
        s = bm.get_stats()
        assert (s.epoch, s.lost_sequences, s.running_sequences) == (2, 1, 0)
        with pytest.raises(DataLoss, match="'x' lost its K/V"):
            bm.get_block_table("x")
        svc.manager.check_invariants()
        state = manager_state(svc.manager)
    with serving(config) as (bm, svc):   # the log replays the same epochs
        assert bm.get_stats().epoch == 2 and manager_state(svc.manager) == state


def test_replaced_worker_group_loses_sequences_with_data_loss(tmp_path):
    """A rank that comes back with another cache id lost its cache: a new epoch, every sequence
    answers DATA_LOSS (naming it) until freed; the same cache id again (a manager restart, a
    dropped heartbeat) loses nothing. Epoch and lost sequences survive a restart."""
    from kvpager.errors import DataLoss

    d = str(tmp_path / "state")
    config = ManagerConfig(**POOL, state_dir=d, worker_heartbeat_timeout=60)

    with serving(config) as (bm, svc):
        register_rank(bm.stub, "A0", 0)
        register_rank(bm.stub, "A1", 1)
        bm.allocate("a", token_ids=list(range(10)))
        bm.allocate("b", token_ids=list(range(6)))
        register_rank(bm.stub, "A0", 0)  # the same cache: nothing lost
        assert bm.get_stats().epoch == 0 and bm.get_block_table("a").num_tokens == 10
        assert bm.health_epoch() == ("SERVING", 0)
        register_rank(bm.stub, "B0", 0)  # rank 0 restarted: its cache is gone
        register_rank(bm.stub, "B1", 1)  # and rank 1 with it: the same replacement, one epoch
        s = bm.get_stats()
        assert (s.epoch, s.lost_sequences, s.running_sequences, s.gpu.used_blocks) == (1, 2, 0, 0)
        assert bm.health_epoch() == ("SERVING", 1)   # health shows the replaced group too
        with pytest.raises(DataLoss, match="'a' lost its K/V"):
            bm.append("a", token_ids=[1])
        with pytest.raises(DataLoss, match="'b'"):
            bm.get_block_table("b")
        with pytest.raises(DataLoss):
            bm.allocate("a", token_ids=[1, 2])
        reply = bm.step([C.append_batch_op(["a", "b"], [1, 2])])
        assert [e.code for _, e in C.batch_failures(reply.results[0])] == ["DATA_LOSS", "DATA_LOSS"]
        bm.free("a")
        bm.allocate("a", token_ids=[1, 2, 3])  # recomputed under its id
        svc.manager.check_invariants()
    with serving(config) as (bm, svc):
        s = bm.get_stats()
        assert (s.epoch, s.lost_sequences, s.running_sequences) == (1, 1, 1)
        assert bm.health_epoch("kvpager.v1.BlockManager")[1] == 1   # before the workers are back
        register_rank(bm.stub, "B0", 0)  # the workers kept their caches across the manager's restart
        register_rank(bm.stub, "B1", 1)
        assert bm.get_stats().epoch == 1 and bm.get_block_table("a").num_tokens == 3
        with pytest.raises(DataLoss):
            bm.fork("b", "c")
        bm.free("b")
        assert bm.get_stats().lost_sequences == 0


def test_a_rolled_back_step_id_is_never_given_again_after_a_restart(tmp_path):
    """A step rolled back after its plan went out (here: dispatch fails UNAVAILABLE) spent its
    step id: some worker may hold that plan. A restarted manager goes on after it."""
    from kvpager.errors import Unavailable

    config = ManagerConfig(**POOL, state_dir=str(tmp_path / "state"))
    with serving(config) as (bm, svc):
        bm.allocate("a", token_ids=list(range(6)))
        first = bm.step([C.append_batch_op(["a"], [1])]).step_id

        def unreachable(plan):
            raise Unavailable(f"step {plan.step_id}: a worker is unreachable")

        svc.manager.dispatch = unreachable
        for _ in range(3):
            with pytest.raises(Unavailable):
                bm.step([C.swap_out_op(["a"])])        # a plan for the workers
        spent = svc.manager.steps      # each attempt (the client retries UNAVAILABLE) spent one
        assert spent >= first + 3
    with serving(config) as (bm, svc):
        table = bm.get_block_table("a")
        assert table.num_tokens == 7 and table.tier == pb.TIER_GPU   # the rolled-back swap-outs are not there
        assert bm.step([C.append_batch_op(["a"], [3])]).step_id == spent + 1
        svc.manager.check_invariants()


def test_the_log_is_measured_in_prometheus(tmp_path):
    """One record per mutating call, timed with its fsync; its bytes; snapshots timed too."""
    config = ManagerConfig(**POOL, state_dir=str(tmp_path / "state"))
    with serving(config) as (bm, svc):
        registry = svc.metrics.registry

        def sample(name: str) -> float:
            return registry.get_sample_value(name) or 0.0

        bm.allocate("a", token_ids=[1, 2, 3])
        appends, nbytes = sample("kvpager_wal_append_duration_seconds_count"), sample("kvpager_wal_bytes_total")
        assert appends >= 1 and nbytes > 0
        bm.free("a")
        bm.get_stats()                 # a read: nothing logged
        assert sample("kvpager_wal_append_duration_seconds_count") == appends + 1
        assert sample("kvpager_wal_bytes_total") > nbytes
        snapshots = sample("kvpager_wal_snapshot_duration_seconds_count")
        with svc.lock, svc.state_lock:
            svc.durable.snapshot()
        assert sample("kvpager_wal_snapshot_duration_seconds_count") == snapshots + 1
