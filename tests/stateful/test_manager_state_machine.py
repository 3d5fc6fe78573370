"""Random operations and steps against a small pool, checked against a tiny reference model,
and against simulated KV data.

The model knows, per live sequence, its tier and the "K/V identity" of each of its tokens (an
interned id that depends on the namespace and the whole prefix up to that token, just as
real K/V does). The test keeps a simulated content for every GPU and CPU block, applies each
plan exactly as a worker would (swap-out, swap-in, copy, then the step's K/V writes through
the slot mapping), and checks that every live sequence, read through its block table, holds
exactly the model's tokens. Cached prompt tokens are never written: a prefix hit, a swap-in
that reuses a cached block, or a copy-on-write that copies the wrong block would serve
another prompt's K/V and fail that check.

Some steps are made tentative (their plan "on its way to the workers", ``manager/tentative.py``)
and finished later, committed or rolled back, in any order, with other steps run in between; the
simulated workers run a tentative plan either at once or only when it commits, and the step's
K/V writes happen when it commits (the scheduler computes after the answer). A call naming one
of its sequences meanwhile must be refused ``Busy`` with nothing changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pytest

from kvpager.manager import (
    Aborted, AlreadyExists, BlockManager, FailedPrecondition, InvalidArgument, ManagerConfig, ManagerError,
    NotFound, OutOfRange, ResourceExhausted,
)
from kvpager.errors import Busy
from kvpager.manager.batch_tables import packed_padded
from kvpager.manager.operations import AllocateOp, AppendBatchOp, AppendOp, ForkOp, FreeOp, SwapInOp, SwapOutOp
from kvpager.manager.plan import AllocateResult, AppendBatchResult, AppendResult, ForkResult, FreeResult, SwapResult
from kvpager.step import unpack_int32
from tests.support.state import fingerprint

NAMES = [f"s{i}" for i in range(10)]
NAMESPACES = ["", "", "", "tenant"]
# Prompts start with a piece of one of these, so that prefix hits happen often.
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 7, 7, 7, 7], [5, 5, 5, 5, 5, 5, 5, 5])
VOCAB = st.integers(0, 3)
OK = None  # the outcome class of a success


def rarely(data, label: str) -> bool:
    """About one draw in ten (a middle value: Hypothesis favours the ends of a range)."""
    return data.draw(st.integers(0, 9), label=label) == 4


def has_running(self) -> bool:
    return any(q.tier == "gpu" for q in self.model.values())


def has_swapped(self) -> bool:
    return any(q.tier == "cpu" for q in self.model.values())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- the reference model ---------------------------------------------------------------------------
class Contents:
    """Interned K/V identities: token i's identity is a function of token i-1's and token i."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}
        self._fresh = 0

    def _intern(self, key: tuple) -> int:
        return self._ids.setdefault(key, len(self._ids))

    def extend(self, values: list[int], namespace: str, tokens) -> None:
        prev = values[-1] if values else self._intern(("root", namespace))
        for t in tokens:
            prev = self._intern((prev, t))
            values.append(prev)

    def unknown_tokens(self, k: int) -> list[tuple]:
        """Tokens given by count only: nothing may match them."""
        out = []
        for _ in range(k):
            self._fresh += 1
            out.append(("unknown", self._fresh))
        return out


@dataclass
class ModelSeq:
    tier: str
    namespace: str
    values: list[int]

    def copy(self) -> "ModelSeq":
        return ModelSeq(self.tier, self.namespace, list(self.values))


@dataclass
class Pending:
    """A tentative step the test opened: what to do when it finishes."""

    step_id: int
    ids: frozenset[str]
    before: dict[str, Optional["ModelSeq"]]   # the model's sequences it names, before it
    plan: tuple                                # (swap_out, swap_in, copy) pairs
    writes: list[tuple[list[int], list]]       # its K/V writes (slots, values), done when it commits
    plan_ran: bool                             # the simulated workers ran the plan when it opened


@dataclass
class StepContext:
    """What the test knows about the step running now (None outside a step)."""

    any_writes: bool = False                                # some K/V is written in this step
    with_tokens: set[str] = field(default_factory=set)      # sequences with tokens to compute
    query: dict[str, int] = field(default_factory=dict)     # expected query length per sequence


# ---- the machine -------------------------------------------------------------------------------------
class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: Optional[BlockManager] = None

    @initialize(
        block_size=st.integers(2, 4),
        num_gpu_blocks=st.integers(8, 24),
        num_cpu_blocks=st.integers(4, 16),
        watermark=st.sampled_from([0.0, 0.1]),
    )
    def setup(self, block_size, num_gpu_blocks, num_cpu_blocks, watermark):
        self.config = ManagerConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                    num_cpu_blocks=num_cpu_blocks, watermark=watermark)
        self.m = BlockManager(self.config)
        self.B = block_size
        self.model: dict[str, ModelSeq] = {}
        self.contents = Contents()
        # Simulated block contents; "junk" is what a block held before anything was written.
        self.gpu = {b: [("junk", "gpu", b, j) for j in range(block_size)] for b in range(num_gpu_blocks)}
        self.cpu = {b: [("junk", "cpu", b, j) for j in range(block_size)] for b in range(num_cpu_blocks)}
        self.pending: dict[int, Pending] = {}

    # ---- drawing operations ------------------------------------------------------------------------
    def _name(self, data, live: set[str], fresh: bool = False, recent: Optional[list[str]] = None) -> str:
        if fresh:
            pool = [n for n in NAMES if n not in live] or NAMES
        elif recent and data.draw(st.booleans(), label="recent"):
            pool = recent  # a sequence this step already named: allocate, fork, append it in one step
        else:
            pool = sorted(live) if live and not rarely(data, "unknown") else NAMES
        return data.draw(st.sampled_from(pool), label="seq")

    def _tokens(self, data, append: bool):
        """(token_ids, num_tokens) of an allocate or append."""
        if data.draw(st.integers(0, 4), label="count only") == 2:
            return None, data.draw(st.integers(1, 3) if append else st.integers(1, 12), label="count")
        if append:
            return data.draw(st.lists(VOCAB, min_size=1, max_size=3), label="ids"), 0
        base = data.draw(st.sampled_from(PREFIXES), label="prefix")
        k = data.draw(st.integers(0, len(base)), label="prefix len")
        tail = data.draw(st.lists(VOCAB, max_size=4), label="tail")
        return (base[:k] + tail) or [0], 0

    def _batch_tokens(self, data, n: int) -> Optional[list[int]]:
        if data.draw(st.integers(0, 4), label="batch count only") == 2:
            return None
        return data.draw(st.lists(VOCAB, min_size=n, max_size=n), label="batch ids")

    @staticmethod
    def _entries(op: AppendBatchOp) -> list[AppendOp]:
        """An AppendBatch is one Append of one token per entry, each on its own."""
        return [AppendOp(s, None if op.token_ids is None else [op.token_ids[i]], 0 if op.token_ids else 1)
                for i, s in enumerate(op.seq_ids)]

    def _seq_list(self, data, live: set[str], tier: str) -> list[str]:
        group = sorted(s for s in live if s in self.model and self.model[s].tier == tier)
        how = data.draw(st.sampled_from(["some", "group", "some", "any", "some", "repeat", "some"]), label="swap list")
        if how == "any" or not group:
            ids = [self._name(data, live)]
        elif how == "some":
            ids = data.draw(st.permutations(group), label="ids")[:data.draw(st.integers(1, 3), label="size")]
        elif how == "group":  # a sequence with every sequence sharing its first block (its fork group)
            first = data.draw(st.sampled_from(group), label="seed")
            b0 = self.m.block_table(first).block_ids[0]
            ids = [s for s in group if self.m.block_table(s).block_ids[0] == b0]
        else:
            ids = [self._name(data, live) for _ in range(2)]  # may repeat: INVALID_ARGUMENT
        return ids

    def _draw_ops(self, data, live: set[str], recent: list[str]) -> list:
        """One operation, or a pattern of a few that schedulers send together."""
        pattern = data.draw(st.sampled_from(["one"] * 6 + ["parallel", "beam", "decode"]), label="pattern")
        if pattern == "parallel":  # admit a prompt with n > 1 samples
            first = self._draw_any_op(data, live, recent, kind="allocate")
            ops = [first, ForkOp(first.seq_id, self._name(data, live, fresh=True))]
            live.add(ops[1].child_seq_id)
        elif pattern == "beam":  # fork a running sequence and extend both
            fork = self._draw_any_op(data, live, recent, kind="fork")
            pair = [fork.parent_seq_id, fork.child_seq_id]
            if data.draw(st.booleans(), label="batched"):
                ops = [fork, AppendBatchOp(pair, self._batch_tokens(data, 2))]
            else:
                ops = [fork] + [AppendOp(s, *self._tokens(data, append=True)) for s in pair]
        elif pattern == "decode":  # one token to each of some sequences, as one AppendBatch
            names = sorted(live | set(recent)) or NAMES
            ids = data.draw(st.permutations(names), label="batch")[:data.draw(st.integers(1, 5), label="size")]
            if rarely(data, "twice"):
                ids = ids + ids[:1]  # two tokens to one sequence
            ops = [AppendBatchOp(ids, self._batch_tokens(data, len(ids)))]
        else:
            ops = [self._draw_any_op(data, live, recent)]
        for op in ops:
            for name in (op.seq_ids if isinstance(op, (SwapOutOp, SwapInOp, AppendBatchOp)) else
                         [op.parent_seq_id, op.child_seq_id] if isinstance(op, ForkOp) else [op.seq_id]):
                if name not in recent:
                    recent.append(name)
        return ops

    def _draw_any_op(self, data, live: set[str], recent: list[str], kind: Optional[str] = None):
        kind = kind or data.draw(st.sampled_from(
            ["allocate"] * 3 + ["append"] * 3 + ["fork", "free", "free"] + ["swap_out", "swap_in"] * 2), label="op")
        if kind == "allocate":
            ids, n = self._tokens(data, append=False)
            name = self._name(data, live, fresh=not rarely(data, "dup"))
            live.add(name)
            return AllocateOp(name, ids, n, data.draw(st.sampled_from(NAMESPACES), label="ns"))
        if kind == "append":
            ids, n = self._tokens(data, append=True)
            return AppendOp(self._name(data, live, recent=recent), ids, n)
        if kind == "fork":
            parent = self._name(data, live, recent=recent)
            child = self._name(data, live, fresh=not rarely(data, "dup"))
            live.add(child)
            return ForkOp(parent, child)
        if kind == "free":
            return FreeOp(self._name(data, live, recent=recent))
        if kind == "swap_out":
            return SwapOutOp(self._seq_list(data, live, "gpu"))
        return SwapInOp(self._seq_list(data, live, "cpu"))

    # ---- expected outcomes -----------------------------------------------------------------------------
    def _expected(self, op, model: dict[str, ModelSeq], ctx: Optional[StepContext]) -> set:
        """The outcome classes the manager may answer with: OK or error types. Exact where the
        model decides; for room, exact or bounded from the pools' counts outside a step."""
        m, B, cfg = self.m, self.B, self.config
        wm, gpu, cpu = m.watermark_blocks, m.gpu, m.cpu
        usable = gpu.num_usable - wm  # the null block is never handed out
        single = ctx is None
        if isinstance(op, AllocateOp):
            if op.seq_id in model:
                return {AlreadyExists}
            nb = cdiv(len(op.token_ids) if op.token_ids else op.num_tokens, B)
            if nb > usable:
                return {OutOfRange}
            if single and nb <= gpu.num_available - wm:  # hits only lower the need
                return {OK}
            return {OK, ResourceExhausted}
        if isinstance(op, AppendOp):
            seq = model.get(op.seq_id)
            if seq is None:
                return {NotFound}
            if seq.tier != "gpu":
                return {FailedPrecondition}
            n, k = len(seq.values), len(op.token_ids) if op.token_ids else op.num_tokens
            if cdiv(n + k, B) > gpu.num_usable:
                return {OutOfRange}
            if single:
                table = m.block_table(op.seq_id).block_ids
                cow = n % B != 0 and gpu.blocks[table[-1]].ref_count > 1
                need = cdiv(n + k, B) - len(table) + cow
                return {ResourceExhausted} if need > gpu.num_available else {OK}
            out = {OK, ResourceExhausted}
            if ctx.any_writes:  # copy-on-write of a block this step writes is refused
                out.add(FailedPrecondition)
            return out
        if isinstance(op, ForkOp):
            parent = model.get(op.parent_seq_id)
            if parent is None:
                return {NotFound}
            if parent.tier != "gpu":
                return {FailedPrecondition}
            if op.child_seq_id in model:
                return {AlreadyExists}
            return {OK}
        if isinstance(op, FreeOp):
            if op.seq_id not in model:
                return {NotFound}
            if ctx is not None and op.seq_id in ctx.with_tokens:
                return {FailedPrecondition}
            return {OK}
        # swaps
        ids = list(op.seq_ids)
        if not ids or len(set(ids)) != len(ids):
            return {InvalidArgument}
        if any(s not in model for s in ids):
            return {NotFound}
        seqs = [model[s] for s in ids]
        blocks = sum(cdiv(len(s.values), B) for s in seqs)
        if isinstance(op, SwapOutOp):
            if any(s.tier != "gpu" for s in seqs):
                return {FailedPrecondition}
            if ctx is not None and any(s in ctx.with_tokens for s in ids):
                return {FailedPrecondition}
            if single:
                distinct = len({b for s in ids for b in m.block_table(s).block_ids})
                if distinct > cfg.num_cpu_blocks:
                    return {OutOfRange}
                return {ResourceExhausted} if distinct > cpu.num_available else {OK}
            out = {OK, ResourceExhausted}
            if blocks > cfg.num_cpu_blocks:
                out.add(OutOfRange)
            if ctx.any_writes:
                out.add(FailedPrecondition)  # a block it shares is written in this step
            return out
        if any(s.tier != "cpu" for s in seqs):
            return {FailedPrecondition}
        if single and blocks <= gpu.num_available - wm:  # reused blocks only lower the need
            return {OK}
        out = {OK}
        if blocks > usable:
            out.add(OutOfRange)
        if blocks > (gpu.num_available - wm if single else 0):
            out.add(ResourceExhausted)
        return out

    def _apply_to_model(self, op, model: dict[str, ModelSeq], ctx: Optional[StepContext], result=None) -> None:
        """Update the model after ``op`` succeeded."""
        if isinstance(op, AllocateOp):
            seq = ModelSeq("gpu", op.namespace, [])
            tokens = op.token_ids if op.token_ids else self.contents.unknown_tokens(op.num_tokens)
            self.contents.extend(seq.values, op.namespace, tokens)
            model[op.seq_id] = seq
            if ctx is not None:
                ctx.any_writes = True
                ctx.with_tokens.add(op.seq_id)
                cached = result.num_cached_tokens if result is not None else 0
                ctx.query[op.seq_id] = len(seq.values) - cached
        elif isinstance(op, AppendOp):
            seq = model[op.seq_id]
            tokens = op.token_ids if op.token_ids else self.contents.unknown_tokens(op.num_tokens)
            self.contents.extend(seq.values, seq.namespace, tokens)
            if ctx is not None:
                ctx.any_writes = True
                ctx.with_tokens.add(op.seq_id)
                ctx.query[op.seq_id] = ctx.query.get(op.seq_id, 0) + len(tokens)
        elif isinstance(op, ForkOp):
            model[op.child_seq_id] = model[op.parent_seq_id].copy()
            if ctx is not None:
                ctx.query[op.child_seq_id] = 0
        elif isinstance(op, FreeOp):
            del model[op.seq_id]
            if ctx is not None:
                ctx.query.pop(op.seq_id, None)
        elif isinstance(op, SwapOutOp):
            for s in op.seq_ids:
                model[s].tier = "cpu"
                if ctx is not None:
                    ctx.query.pop(s, None)
        elif isinstance(op, SwapInOp):
            for s in op.seq_ids:
                model[s].tier = "gpu"
                if ctx is not None:
                    ctx.any_writes = True
                    ctx.query.setdefault(s, 0)

    def _check_result(self, op, result, model: dict[str, ModelSeq]) -> None:
        """Shapes of a success's result against the model (after the op was applied to it)."""
        B = self.B
        if isinstance(op, AllocateOp):
            assert isinstance(result, AllocateResult)
            n = len(model[op.seq_id].values)
            assert len(result.block_ids) == cdiv(n, B) and len(result.slot_mapping) == n
            assert result.num_cached_tokens % B == 0 and 0 <= result.num_cached_tokens < n
            if not op.token_ids:
                assert result.num_cached_tokens == 0
            assert result.slot_mapping == [result.block_ids[i // B] * B + i % B for i in range(n)]
        elif isinstance(op, AppendOp):
            assert isinstance(result, AppendResult)
            k = len(op.token_ids) if op.token_ids else op.num_tokens
            assert result.num_tokens == len(model[op.seq_id].values) and len(result.slot_mapping) == k
            assert len(result.copies) <= 1
        elif isinstance(op, ForkOp):
            assert isinstance(result, ForkResult)
        elif isinstance(op, FreeOp):
            assert isinstance(result, FreeResult)
        else:
            assert isinstance(result, SwapResult)
            if isinstance(op, SwapOutOp):
                assert result.num_blocks_reused == 0

    # ---- simulated workers -------------------------------------------------------------------------------
    def _run_plan(self, swap_out=(), swap_in=(), copy=()) -> None:
        for g, c in swap_out:
            self.cpu[c] = list(self.gpu[g])
        for c, g in swap_in:
            self.gpu[g] = list(self.cpu[c])
        snapshot = {src: list(self.gpu[src]) for src, _ in copy}  # one gather, then one scatter
        for src, dst in copy:
            self.gpu[dst] = list(snapshot[src])

    def _write(self, slots: list[int], values: list[int]) -> None:
        assert len(slots) == len(values)
        for slot, value in zip(slots, values):
            self.gpu[slot // self.B][slot % self.B] = value

    # ---- rules -------------------------------------------------------------------------------------------
    def _refused_busy(self, run, ops) -> bool:
        """A call naming a sequence of a tentative step: ``Busy``, nothing changed."""
        if self.m.tentative.busy_with(ops) is None:
            return False
        before = fingerprint(self.m)
        with pytest.raises(Busy):
            run()
        assert fingerprint(self.m) == before, f"{ops}: refused Busy but changed the state"
        return True

    def _single(self, op) -> None:
        if self._refused_busy(lambda: self.m.run(op), [op]):
            return
        expected = self._expected(op, self.model, None)
        before = fingerprint(self.m)
        try:
            result, error = self.m.run(op), None
        except ManagerError as err:
            result, error = None, err
        got = OK if error is None else type(error)
        assert got in expected, f"{op}: got {got.__name__ if got else 'success'} ({error}), expected {expected}"
        if error is not None:
            assert fingerprint(self.m) == before, f"failed {op} changed the state"
            return
        n_before = len(self.model[op.seq_id].values) if isinstance(op, AppendOp) else 0
        self._apply_to_model(op, self.model, None, result)
        self._check_result(op, result, self.model)
        if isinstance(op, AllocateOp):
            cached = result.num_cached_tokens
            self._write(result.slot_mapping[cached:], self.model[op.seq_id].values[cached:])
        elif isinstance(op, AppendOp):
            self._run_plan(copy=result.copies.pairs())
            self._write(result.slot_mapping, self.model[op.seq_id].values[n_before:])
        elif isinstance(op, SwapOutOp):
            self._run_plan(swap_out=result.mapping.pairs())
        elif isinstance(op, SwapInOp):
            self._run_plan(swap_in=result.mapping.pairs())

    @rule(data=st.data())
    def allocate(self, data):
        free, names = self.m.gpu.num_free, [n for n in NAMES if n not in self.model]
        if free and names and data.draw(st.integers(0, 4), label="fill") == 2:
            # A count-only admission that takes exactly the free list: the next allocations
            # must evict from the prefix cache.
            self._single(AllocateOp(data.draw(st.sampled_from(names), label="seq"), None, free * self.B))
            return
        ids, n = self._tokens(data, append=False)
        name = self._name(data, set(self.model), fresh=not rarely(data, "dup"))
        self._single(AllocateOp(name, ids, n, data.draw(st.sampled_from(NAMESPACES), label="ns")))

    @precondition(has_running)
    @rule(data=st.data())
    def append(self, data):
        ids, n = self._tokens(data, append=True)
        self._single(AppendOp(self._name(data, set(self.model)), ids, n))

    @precondition(has_running)
    @rule(data=st.data())
    def fork(self, data):
        live = set(self.model)
        parent = self._name(data, live)
        self._single(ForkOp(parent, self._name(data, live, fresh=not rarely(data, "dup"))))

    @precondition(has_running)
    @rule(data=st.data())
    def free(self, data):
        self._single(FreeOp(self._name(data, set(self.model))))

    @precondition(has_running)
    @rule(data=st.data())
    def swap_out(self, data):
        self._single(SwapOutOp(self._seq_list(data, set(self.model), "gpu")))

    @precondition(has_swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        self._single(SwapInOp(self._seq_list(data, set(self.model), "cpu")))

    @rule(data=st.data())
    def step(self, data):
        self._step(data, tentative=False)

    @rule(data=st.data())
    def tentative_step(self, data):
        """A step whose plan goes to the workers: it stays tentative until ``finish_tentative``."""
        self._step(data, tentative=True)

    @precondition(lambda self: self.m is not None and self.pending)
    @rule(data=st.data())
    def finish_tentative(self, data):
        step_id = data.draw(st.sampled_from(sorted(self.pending)), label="tentative step")
        ok = data.draw(st.booleans(), label="workers ran it")
        p = self.pending.pop(step_id)
        if ok:
            if not p.plan_ran:
                self._run_plan(*p.plan)
            self.m.finish_tentative(step_id, True)
            for slots, values in p.writes:
                self._write(slots, values)
        else:
            self.m.finish_tentative(step_id, False)
            for seq_id, seq in p.before.items():
                if seq is None:
                    self.model.pop(seq_id, None)
                else:
                    self.model[seq_id] = seq

    def _step(self, data, tentative: bool):
        live = set(self.model)
        recent: list[str] = []
        ops = []
        for _ in range(data.draw(st.integers(1, 5), label="num patterns")):
            ops.extend(self._draw_ops(data, live, recent))
        all_or_nothing = data.draw(st.integers(0, 4), label="all or nothing") == 2
        if self._refused_busy(lambda: self.m.step(ops, all_or_nothing=all_or_nothing, hold_open=tentative), ops):
            return
        before = fingerprint(self.m)
        models_before = dict(self.model)
        r = self.m.step(ops, all_or_nothing=all_or_nothing, hold_open=tentative)
        assert len(r.outcomes) == len(ops)
        assert all((o.result is None) != (o.error is None) for o in r.outcomes)

        shadow = {k: v.copy() for k, v in self.model.items()}
        ctx = StepContext()
        if not r.applied:
            assert all_or_nothing
            failed = [i for i, o in enumerate(r.outcomes) if type(o.error) is not Aborted]
            assert len(failed) == 1, r.outcomes
            at = failed[0]
            for op in ops[:at]:  # these ran and succeeded before the failure
                for part in self._entries(op) if isinstance(op, AppendBatchOp) else [op]:
                    assert OK in self._expected(part, shadow, ctx), part
                    self._apply_to_model(part, shadow, ctx)
            got = type(r.outcomes[at].error)
            if isinstance(ops[at], AppendBatchOp):  # the first entry that failed fails it whole
                plausible = set()
                for part in self._entries(ops[at]):
                    expected = self._expected(part, shadow, ctx)
                    plausible |= expected - {OK}
                    if OK not in expected:
                        break
                    self._apply_to_model(part, shadow, ctx)
            else:
                plausible = self._expected(ops[at], shadow, ctx)
            assert got in plausible, (ops[at], r.outcomes[at].error)
            assert fingerprint(self.m) == before, "an all-or-nothing step that failed changed the state"
            plan = r.plan
            assert not (plan.blocks_to_copy or plan.blocks_to_swap_in or plan.blocks_to_swap_out)
            assert r.batch.seq_ids == [] and r.batch.slot_mapping == []
            return

        for op, outcome in zip(ops, r.outcomes):
            if isinstance(op, AppendBatchOp) and outcome.error is None:
                assert isinstance(outcome.result, AppendBatchResult)
                failures = dict(outcome.result.failures)
                assert sorted(failures) == [i for i, _ in outcome.result.failures]
                for i, part in enumerate(self._entries(op)):
                    expected = self._expected(part, shadow, ctx)
                    got = type(failures[i]) if i in failures else OK
                    assert got in expected, f"{op} entry {i}: got {got.__name__ if got else 'success'} ({failures.get(i)}), expected {expected}"
                    if got is OK:
                        self._apply_to_model(part, shadow, ctx)
                continue
            expected = self._expected(op, shadow, ctx)
            got = OK if outcome.error is None else type(outcome.error)
            assert got in expected, f"{op}: got {got.__name__ if got else 'success'} ({outcome.error}), expected {expected}"
            if outcome.error is None:
                self._apply_to_model(op, shadow, ctx, outcome.result)
                self._check_result(op, outcome.result, shadow)
        self.model = shadow

        # The worker: the merged plan in its fixed order, then the step's K/V writes.
        plan, batch, B = r.plan, r.batch, self.B
        pairs = (plan.blocks_to_swap_out.pairs(), plan.blocks_to_swap_in.pairs(), plan.blocks_to_copy.pairs())
        opened = r.step_id in self.m.tentative.steps
        assert opened == (tentative and any(pairs)), (tentative, pairs)
        writes: list[tuple[list[int], list]] = []
        plan_ran = not opened or data.draw(st.booleans(), label="plan runs at once")
        if plan_ran:
            self._run_plan(*pairs)
        assert len(set(plan.blocks_to_copy.dst)) == len(plan.blocks_to_copy.dst)
        assert not set(plan.blocks_to_copy.dst) & set(plan.blocks_to_copy.src), "chained copies"
        assert len(batch.seq_ids) == len(set(batch.seq_ids))
        assert sum(batch.query_lens) == len(batch.slot_mapping)
        assert len(batch.block_tables) == len(batch.seq_ids) * batch.max_blocks
        assert batch.kv_indptr[0] == 0 and len(batch.kv_indptr) == len(batch.seq_ids) + 1
        offset = 0
        for i, seq_id in enumerate(batch.seq_ids):
            seq = self.model[seq_id]
            assert seq.tier == "gpu"
            ctx_len, q = batch.context_lens[i], batch.query_lens[i]
            assert ctx_len == len(seq.values) and q == ctx.query[seq_id]
            table = self.m.block_table(seq_id).block_ids
            assert batch.kv_indices[batch.kv_indptr[i]:batch.kv_indptr[i + 1]] == table
            row = batch.block_tables[i * batch.max_blocks:(i + 1) * batch.max_blocks]
            assert row == table + [0] * (batch.max_blocks - len(table))
            assert batch.kv_last_page_len[i] == ctx_len - (len(table) - 1) * B
            writes.append((batch.slot_mapping[offset:offset + q], seq.values[ctx_len - q:]))
            offset += q
        if opened:
            ids = self.m.tentative.steps[r.step_id].ids
            self.pending[r.step_id] = Pending(r.step_id, ids, {s: models_before.get(s) for s in ids}, pairs, writes,
                                              plan_ran)
        else:
            for slots, values in writes:
                self._write(slots, values)
        assert set(batch.seq_ids) == set(ctx.query), (batch.seq_ids, ctx.query)
        # The packed padded table (TABLE_LAYOUT_PADDED_PACKED), from rows the manager keeps across
        # steps, rollbacks and swaps: it must always equal the list form.
        seqs = [self.m.seqs.get(s) for s in batch.seq_ids]
        packed = packed_padded(seqs, [len(s.block_ids) for s in seqs], batch.max_blocks)
        assert unpack_int32(packed).tolist() == batch.block_tables
        assert batch.max_blocks == max((cdiv(len(self.model[s].values), B) for s in batch.seq_ids), default=0)

    # ---- invariants --------------------------------------------------------------------------------------
    @invariant()
    def manager_agrees_with_the_model(self):
        m = self.m
        if m is None:
            return
        m.check_invariants()
        assert len(m.seqs) == len(self.model)
        for seq_id, seq in self.model.items():
            actual = m.block_table(seq_id)
            assert actual.num_tokens == len(seq.values) and actual.tier == seq.tier
            assert len(actual.block_ids) == cdiv(len(seq.values), self.B)
        s = m.stats()
        assert s.running_sequences == sum(q.tier == "gpu" for q in self.model.values())
        assert s.swapped_sequences == sum(q.tier == "cpu" for q in self.model.values())
        for tier in (s.gpu, s.cpu):
            assert tier.used_blocks + tier.free_blocks + tier.cached_blocks == tier.total_blocks
        # The operation counts the metrics export count only what committed: every live sequence
        # was allocated or forked, and not freed (tentative steps count when they finish).
        applied = m.op_counts.applied
        if not self.pending:
            assert applied["allocate"] + applied["fork"] - applied["free"] == len(self.model), dict(applied)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        if self.m is None:
            return
        B = self.B
        busy = {s for p in self.pending.values() for s in p.ids}  # their K/V is written when they commit
        for seq_id, seq in self.model.items():
            if seq_id in busy:
                continue
            table = self.m.block_table(seq_id).block_ids
            data = self.gpu if seq.tier == "gpu" else self.cpu
            got = [data[table[i // B]][i % B] for i in range(len(seq.values))]
            assert got == seq.values, f"{seq_id} ({seq.tier}) reads wrong K/V: table {table}"


ManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerStateMachine = ManagerMachine.TestCase
