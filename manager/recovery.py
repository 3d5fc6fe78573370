"""Durable manager state: what the service logs for each call, snapshots, and recovery at start.

The log is kept at the level of ``BlockManager.step``: each committed step is recorded as the
operations it received (after the service decoded them, tenants mapped), with its
all-or-nothing flag, batch flag and table layout, its step id and its outcome codes. Replaying
a record re-runs ``BlockManager.step`` on the recovered state (no workers attached) and checks
that it gets the same step id and the same outcome codes: the manager is deterministic, so the
replayed state is the state that was acknowledged.

One record per call (a Step or one mutating RPC): its committed steps, the request-id cache
entry it stored (request id, fingerprint, answer: so a retry after a restart gets the first
answer) and manager events (the pools created from the workers' capacity, the prefix cache
forgotten because a worker was replaced). ``Durability.commit`` writes it while the service
holds its state lock, before the answer leaves. A call that changed nothing writes nothing.

A step whose plan goes to the workers is tentative while they run it (``manager/tentative.py``)
and other calls are logged meanwhile, so it takes two records: ("open", ...) written when it
becomes tentative, before the lock is released, and ("finish", step id, committed) in its call's
record. Replay reopens it at the same place and finishes it where the log says; one never
finished (the manager died while the workers ran its plan) was never answered: it is rolled back
at the end of recovery.

A snapshot (every ``snapshot_records`` records) is taken only with no step tentative: it is plain
data, and so recovery never has to rebuild a half-done step from it. Under steady swap traffic
some step nearly always is, so a due snapshot sets ``TentativeSteps.draining`` and the manager
holds back new steps that may move blocks (they wait as for a busy sequence) until the open ones
finish, each within the plan timeout; the commit of the last finish takes it. The log after a
snapshot is then bounded by about ``snapshot_records`` plus those finishes and the calls logged
beside them (docs/durability.md, "Snapshots and log rotation").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence as Seq

from kvpager.errors import Busy, ManagerError, Unavailable
from kvpager.status import error_for, status_of
from .block_manager import BlockManager
from .config import ManagerConfig
from .epochs import WorkerCaches, holds_state
from .operations import Operation
from .plan import ExecutionPlan, StepResult, TableLayout
from .request_cache import Answer, RequestCache
from .snapshot import config_from, manager_state, restore_manager
from .state import StepFn
from .wal import EXIT_LOG_FAILED, CorruptState, StateDir

if TYPE_CHECKING:
    from .metrics import ManagerMetrics

log = logging.getLogger("kvpager.manager")

Decision = Optional[tuple[str, str]]  # an admission check's outcome: None (admitted) or (status, message)


def _plain(op: Operation) -> Operation:
    """The operation with its sequences as lists (the service builds them over protobuf containers)."""
    fields = {f.name: getattr(op, f.name) for f in dataclasses.fields(op)}
    changes = {name: list(v) for name, v in fields.items()
               if v is not None and not isinstance(v, (str, int, bytes, list))}
    return type(op)(**{**fields, **changes}) if changes else op


def _codes(result: StepResult) -> list[Optional[str]]:
    return [None if o.error is None else status_of(o.error) for o in result.outcomes]


class Logged(Protocol):
    """What Durability reads and sets of the service that owns it (``BlockManagerService``)."""

    config: ManagerConfig
    manager: Optional[BlockManager]
    requests: RequestCache
    caches: WorkerCaches
    metrics: ManagerMetrics
    awaiting_workers: bool

    def _dispatch(self, plan: ExecutionPlan) -> None: ...


# ---- the service's side -------------------------------------------------------------------------
class Durability:
    """Logs what the service applies and recovers it at start. Every method runs under the
    service's state lock."""

    def __init__(self, service: Logged, state_dir: StateDir) -> None:
        self.service = service
        self.dir = state_dir
        self._pending: list[tuple[Any, ...]] = []   # what the current call changed: ("step", ...), ("event", ...)
        # Request-id entries stored by the current call: (request id, fingerprint, answer, wall time).
        self._request: list[tuple[str, bytes, Answer, float]] = []
        self._wrapped: Optional[BlockManager] = None
        self.closed = False   # by ``close``, at shutdown
        service.requests.on_put = self._note_request

    def _note_request(self, request_id: str, print_: bytes, answer: Answer) -> None:
        self._request.append((request_id, print_, answer, time.time()))

    # ---- logging --------------------------------------------------------------------------------
    def _wrap(self) -> None:
        """Log every step of the service's manager from now on (and its config, once)."""
        m = self.service.manager
        if m is None or m is self._wrapped:
            return
        self._pending.append(("config", dataclasses.asdict(m.config)))

        def log_step(apply: StepFn, ops: Seq[Operation], all_or_nothing: bool, batch: bool,
                     before_commit: Optional[Callable[[StepResult], None]], layout: TableLayout,
                     hold_open: bool) -> StepResult:
            return self._log_step(m, apply, list(ops), all_or_nothing, batch, before_commit, layout, hold_open)

        m.step_log = log_step
        self._wrapped = m

    def _log_step(self, m: BlockManager, apply: StepFn, ops: list[Operation], all_or_nothing: bool, batch: bool,
                  before_commit: Optional[Callable[[StepResult], None]], layout: TableLayout,
                  hold_open: bool) -> StepResult:
        """Run one step of ``m`` and log it: ("step", ...) when it commits at once; ("open", ...)
        when it becomes tentative and ("finish", ...) when the workers answered."""
        pending = self._pending
        before = m.steps
        # The service's admission hooks (tenant quotas of blocks and of sequences) decide outside
        # the manager's state: each hook's decisions are logged, in order, and replayed as they were.
        live_admit, live_admit_sequence = m.admit, m.admit_sequence
        decisions: Optional[list[Decision]] = None if live_admit is None else []
        sequence_decisions: Optional[list[Decision]] = None if live_admit_sequence is None else []
        if live_admit is not None:
            m.admit = _recording(live_admit, decisions)
        if live_admit_sequence is not None:
            m.admit_sequence = _recording(live_admit_sequence, sequence_decisions)
        opened: list[int] = []

        def on_tentative(result: StepResult) -> None:
            # Written now, before the lock is released: calls logged while the workers run its
            # plan were applied after it.
            opened.append(result.step_id)
            pending.append(("open", before, [_plain(op) for op in ops], all_or_nothing, batch, layout,
                            _codes(result), decisions, sequence_decisions))
            self.commit()   # synced: its plan goes to the workers next, and its step id must stay spent

        m.on_tentative = on_tentative
        try:
            result = apply(ops, all_or_nothing, batch, before_commit, layout, hold_open)
        except Busy:  # refused before anything was applied: nothing to log
            raise
        except BaseException as exc:
            if opened:  # the workers failed its plan: rolled back
                pending.append(("finish", opened[0], False, status_of(exc) if isinstance(exc, ManagerError) else None))
            else:
                # Rolled back (an answer too large, a bug, a refused dispatch), yet its step id
                # is spent: its plan may have reached some workers. Logged, so that a restarted
                # manager never gives that id to another step.
                # With its operations and failure, so that a restarted manager counts them as
                # the live one did (operation counts, manager/counts.py).
                code = status_of(exc) if isinstance(exc, ManagerError) else None
                pending.append(("event", "steps_used", m.steps, [_plain(op) for op in ops], code))
            raise
        finally:
            m.on_tentative = None
            if live_admit is not None:
                m.admit = live_admit
            if live_admit_sequence is not None:
                m.admit_sequence = live_admit_sequence
        if opened:
            pending.append(("finish", opened[0], True, None))
        else:
            pending.append(("step", before, [_plain(op) for op in ops], all_or_nothing, batch, layout,
                            _codes(result), decisions, sequence_decisions))
        return result

    def event(self, *what: Any) -> None:
        """A change made outside BlockManager.step (e.g. ("forget_gpu_contents",))."""
        self._wrap()
        self._pending.append(("event", *what))

    def commit(self) -> None:
        """Write what the current call changed as one record (nothing when it changed nothing).
        Called under the state lock before the answer is sent (and before a tentative step's plan
        goes to the workers). A failed write ends the process: the change is applied in memory but
        could not be made durable, so it must not be answered."""
        self._wrap()
        if not self._pending and not self._request:
            return
        if self.closed:
            # Only a call that outlived the shutdown's bounded wait gets here (service.close): the
            # server stopped, so its answer cannot leave, and a restart recovers what was answered.
            log.warning("not logged, the log is closed (shutting down): %d changes of a call that was not answered",
                        len(self._pending))
            self._pending.clear()
            self._request.clear()
            return
        m = self.service.manager
        if m is not None and m._step is not None:  # a read while a mutation waits on the workers: its turn comes
            return
        record = {"changes": list(self._pending), "requests": list(self._request)}
        try:
            self.dir.append(record)
        except BaseException:
            log.critical("cannot write the state log in %s; stopping (nothing unlogged is answered; a restart "
                         "recovers the logged state)", self.dir.path, exc_info=True)
            os._exit(EXIT_LOG_FAILED)
        self._pending.clear()
        self._request.clear()
        if not self.dir.due():
            return
        if m is not None and m.tentative:
            # A snapshot holds no step half done, and under steady swap traffic some step nearly
            # always is: hold back new steps that may move blocks until the open ones finish (each
            # within the plan timeout); the commit of the last one's finish takes the snapshot.
            m.tentative.draining = True
            return
        if m is not None:
            m.tentative.draining = False
        try:
            self.snapshot()
        except OSError:
            # The change is applied and in the log, so its answer stands; the log keeps growing
            # until a later snapshot succeeds (wal.py StateDir.snapshot leaves it consistent).
            self.dir.defer_snapshot()
            log.warning("state snapshot failed in %s; the log keeps every change, the next snapshot is tried "
                        "after %d more records", self.dir.path, self.dir.snapshot_records, exc_info=True)

    def snapshot(self) -> None:
        started = time.perf_counter()
        m = self.service.manager
        entries = self.service.requests.entries()
        self.dir.snapshot({"manager": None if m is None else manager_state(m), "requests": entries,
                           "caches": self.service.caches.state()})
        log.info("state snapshot %d written in %.3f s", self.dir.snapshots, time.perf_counter() - started)

    # ---- recovery -------------------------------------------------------------------------------
    def recover(self) -> str:
        """Load the snapshot, replay the log, check invariants; then take a fresh snapshot (so the
        log starts empty). Returns a one-line summary. Raises CorruptState."""
        started = time.perf_counter()
        snap, records = self.dir.load()
        service = self.service
        m: Optional[BlockManager] = None
        if snap is not None:
            wall_age = time.time() - snap["written_at"]
            if snap["manager"] is not None:
                m = restore_manager(snap["manager"], config_from(snap["manager"]["config"]))
            self.service.caches.restore(snap["caches"])
            for rid, p, answer, age in snap["requests"]:
                self._restore_request(rid, p, answer, age + wall_age)
        replayed = 0
        for i, record in enumerate(records):
            for change in record["changes"]:
                m = self._replay(m, change, i)
            for rid, p, answer, t in record["requests"]:
                self._restore_request(rid, p, answer, time.time() - t)
            replayed += 1
        unfinished = sorted(m.tentative.steps) if m is not None else []
        for step_id in unfinished:  # its plan was out when the manager stopped: never answered
            if m is not None:
                m.finish_tentative(step_id, False)
        if unfinished:
            log.info("rolled back %d steps whose plans were with the workers when the manager stopped: %s",
                     len(unfinished), unfinished)
        if m is not None:
            m.check_invariants()
            m = self._adopt(m)
            service.manager = m
            self._wrapped = None
            if service.config.sized_by_workers or service.caches.ranks:
                m.dispatch = self._until_workers_return
                service.awaiting_workers = True
        self._request.clear()
        self._pending.clear()
        self._wrap()
        self._pending.clear()  # the snapshot below holds the config
        self.snapshot()
        what = "nothing to recover" if snap is None and not records else (
            f"recovered {len(m.seqs) if m else 0} sequences, {len(service.requests)} request-id answers "
            f"(snapshot {'yes' if snap else 'no'}, {replayed} log records replayed"
            + (f"; dropped a torn last record: {self.dir.dropped}" if self.dir.dropped else "") + ")")
        return f"state directory {self.dir.path}: {what} in {time.perf_counter() - started:.3f} s"

    def _until_workers_return(self, plan: ExecutionPlan) -> None:
        """The recovered manager's dispatch until a worker registers again (``_register`` then sets
        the service's own): a plan that moves blocks needs the workers that hold them, so it is
        refused UNAVAILABLE (the step rolls back) rather than applied without them."""
        if plan.blocks_to_swap_out.src or plan.blocks_to_swap_in.src or plan.blocks_to_copy.src:
            raise Unavailable(f"step {plan.step_id}: the workers have not registered again since the manager "
                              "restarted; the step was not applied")
        self.service._dispatch(plan)

    def _restore_request(self, rid: str, p: bytes, answer: Answer, age: float) -> None:
        requests = self.service.requests
        requests.restore(rid, p, answer, requests.clock() - max(age, 0.0))

    def _replay(self, m: Optional[BlockManager], change: tuple[Any, ...], index: int) -> Optional[BlockManager]:
        kind = change[0]
        if kind == "config":
            config = config_from(change[1])
            if m is None:
                return BlockManager(config)
            if (config.block_size, config.num_gpu_blocks, config.num_cpu_blocks) != (
                    m.config.block_size, m.gpu.num_blocks, m.cpu.num_blocks):
                raise CorruptState(f"log record {index}: a config with other pool sizes for an existing manager")
            m.config, m.watermark_blocks = config, config.watermark_blocks
            return m
        if kind == "event" and change[1] == "worker_cache" and m is None:  # registered before the pools existed
            self.service.caches.register(change[2], change[3])
            return m
        if m is None:
            raise CorruptState(f"log record {index}: {kind} before any pool exists")
        if kind in ("step", "open"):
            # Logs written before the sequence quota existed end at the block quota's decisions.
            _, before, ops, all_or_nothing, batch, layout, codes, decisions, *rest = change
            sequence_decisions: Optional[list[Decision]] = rest[0] if rest else None
            m.steps = before
            args = {} if layout is None else {"layout": layout}
            m.admit = _replaying(decisions)
            m.admit_sequence = _replaying(sequence_decisions)
            try:
                result = m.step(ops, all_or_nothing, batch, **args, hold_open=kind == "open")
            except ManagerError as err:
                raise CorruptState(f"log record {index}: replaying step {before + 1} raised {err!r}") from err
            finally:
                m.admit = m.admit_sequence = None
            if (kind == "open") != (result.step_id in m.tentative.steps):
                raise CorruptState(f"log record {index}: step {result.step_id} was logged "
                                   f"{'tentative' if kind == 'open' else 'committed'} but does not replay so")
            if result.step_id != before + 1 or _codes(result) != codes:
                raise CorruptState(f"log record {index}: replaying step {before + 1} gave step {result.step_id} with "
                                   f"outcomes {_codes(result)}, the log says {codes}: refusing to start")
        elif kind == "finish":
            if change[1] not in m.tentative.steps:
                raise CorruptState(f"log record {index}: finish of step {change[1]}, which is not open")
            _, step_id, ok, code = change
            m.finish_tentative(step_id, ok, None if code is None else error_for(code, ""))
        elif kind == "event" and change[1] == "steps_used":
            m.steps = max(m.steps, change[2])
            if len(change) > 3:   # the rolled-back step's operations, each counted failed
                _, _, _, ops, code = change
                m.op_counts.record(ops, [], False, None if code is None else error_for(code, ""))
        elif kind == "event" and change[1] == "forget_gpu_contents":
            m.gpu.forget_contents()
        elif kind == "event" and change[1] == "worker_cache":
            if self.service.caches.register(change[2], change[3], holds_state(m)):
                m.lose_all(self.service.caches.epoch)
        else:
            raise CorruptState(f"log record {index}: unknown change {kind!r}")
        return m

    def _adopt(self, m: BlockManager) -> BlockManager:
        """The recovered manager under the configuration given now: pool sizes and block size
        must be the recovered ones (blocks on the workers are addressed by them), and so must
        prefix caching (the GPU pool keeps or frees released blocks by it); the rest (watermark,
        bounds) follows the flags."""
        now = self.service.config
        if now.block_size != m.config.block_size:
            raise CorruptState(f"the state in {self.dir.path} has block size {m.config.block_size}; --block-size says "
                               f"{now.block_size}. Start with the same block size, or move the directory away")
        if not now.sized_by_workers and (now.num_gpu_blocks, now.num_cpu_blocks) != (m.gpu.num_blocks,
                                                                                   m.cpu.num_blocks):
            raise CorruptState(
                f"the state in {self.dir.path} has pools of {m.gpu.num_blocks} GPU / {m.cpu.num_blocks} CPU blocks; "
                f"the flags say {now.num_gpu_blocks} / {now.num_cpu_blocks}. Start with the same sizes (or "
                "--num-gpu-blocks 0 to keep the recovered ones), or move the directory away")
        if now.enable_prefix_caching != m.config.enable_prefix_caching:   # the GPU pool was built with it
            raise CorruptState(
                f"the state in {self.dir.path} was written with prefix caching "
                f"{'on' if m.config.enable_prefix_caching else 'off'}; the flags say "
                f"{'on' if now.enable_prefix_caching else 'off'}. Start with the same setting, or move the directory "
                "away")
        config = dataclasses.replace(now, num_gpu_blocks=m.gpu.num_blocks, num_cpu_blocks=m.cpu.num_blocks)
        m.config, m.watermark_blocks = config, config.watermark_blocks
        return m

    def close(self) -> None:
        """Close the log; ``commit`` writes nothing after (the service closes it once no call is left
        that could write: ``BlockManagerService.close``)."""
        self.closed = True
        self.dir.close()


def open_state(service: Logged) -> Durability:
    """Open ``service.config.state_dir``, recover what it holds into ``service`` and return the
    Durability that logs from now on. Raises CorruptState (the manager must not start)."""
    config = service.config
    state = StateDir(config.state_dir, config.fsync)
    service.metrics.watch_state_dir(state)
    durable = Durability(service, state)
    try:
        log.info("%s", durable.recover())
    except BaseException:
        state.close()
        raise
    return durable


def _recording(hook: Callable[..., None], made: Optional[list[Decision]]) -> Callable[..., None]:
    """``hook`` (an admission hook of the service), with each decision it makes appended to
    ``made``: None for a pass, (status, message) for a refusal, which it raises as before."""
    assert made is not None

    def admit(*args: Any) -> None:
        try:
            hook(*args)
        except ManagerError as err:
            made.append((status_of(err), str(err)))
            raise
        made.append(None)

    return admit


def _replaying(decisions: Optional[list[Decision]]) -> Optional[Callable[..., None]]:
    """An admission hook that makes the logged ``decisions`` again, in order (None: none logged)."""
    if decisions is None:
        return None
    replayed = iter(decisions)

    def admit(*args: Any) -> None:
        decision = next(replayed, None)
        if decision is not None:
            raise error_for(decision[0], decision[1])

    return admit
