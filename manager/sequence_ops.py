"""The operations on sequences: allocate (with prefix-cache hits), append (copy-on-write of a
shared last block; the in-place decode fast path), append_batch, fork and free, with the
prefix-hash chain they extend. Each validates everything before changing anything and records
its changes in the journal. Costs: see ``manager/block_manager.py``."""

from __future__ import annotations

from typing import NoReturn, Optional, Sequence as Seq

from kvpager.numeric import ceil_div
from kvpager.errors import (
    FailedPrecondition,
    InvalidArgument,
    InvariantViolation,
    ManagerError,
    OutOfRange,
    ResourceExhausted,
    quote,
)
from .operations import (
    AllocateOp, AppendBatchOp, AppendOp, ForkOp, FreeOp, RejectedOp,
)
from .plan import (
    AllocateResult,
    AppendBatchResult,
    AppendResult,
    BlockMapping,
    ForkResult,
    FreeResult,
)
from .prefix_hash import chain_hash, root_hash
from .tenancy import client_len
from .block import Block
from .sequence import GPU, Sequence
from .state import ManagerState

# The undo record of an in-place append that filled its block or broke its hash chain (``_append_batch``):
# (sequence, its last block, its length before, its pending tokens list and that list's length
# before, its prefix hash before).
_InPlace = tuple[Sequence, Block, int, Optional[list[int]], int, Optional[bytes]]


class SequenceOperations(ManagerState):
    @staticmethod
    def _reject(op: RejectedOp) -> NoReturn:
        raise InvalidArgument(op.reason)

    def _allocate(self, op: AllocateOp) -> AllocateResult:
        self._check_new_id(op.seq_id)
        if client_len(op.namespace) > self.config.max_id_len:
            raise InvalidArgument(
                f"allocate {quote(op.seq_id)}: cache_namespace is {client_len(op.namespace)} characters; the limit is "
                f"{self.config.max_id_len} (max_id_len)")
        tokens = op.token_ids or None
        n = self._count(tokens, op.num_tokens, "prompt")
        B, gpu = self.block_size, self.gpu
        num_blocks = ceil_div(n, B)
        # The answer holds the prompt's slots twice (result and batch) and its table once in the
        # result and once per table layout of the batch.
        self._charge(2 * n + (1 + self._table_copies()) * num_blocks, f"allocate {quote(op.seq_id)}")
        usable = gpu.num_usable - self.watermark_blocks
        if num_blocks > usable:
            raise OutOfRange(
                f"allocate {quote(op.seq_id)}: a prompt of {n} tokens needs {num_blocks} blocks; the GPU pool can "
                f"never give more than {usable} ({gpu.num_usable} minus a reserve of {self.watermark_blocks})")

        prompt = tokens if self.config.enable_prefix_caching else None  # the tokens to hash, when caching
        hashes: list[bytes] = []
        hits: list[int] = []
        last_hash: Optional[bytes] = None
        if prompt is not None:
            last_hash = root_hash(op.namespace)
            for i in range(n // B):
                last_hash = chain_hash(last_hash, prompt[i * B:(i + 1) * B])
                hashes.append(last_hash)
            for h in hashes:
                bid = gpu.lookup(h)
                if bid is None:
                    break
                hits.append(bid)
            if len(hits) == num_blocks:
                hits.pop()  # the whole prompt is cached: recompute its last block to get logits

        new = num_blocks - len(hits)
        self._admit_sequence(f"allocate {quote(op.seq_id)}", num_blocks)
        self._admit(f"allocate {quote(op.seq_id)}", new, hits)

        owner = self.seqs.owner(op.seq_id)
        for b in hits:
            gpu.acquire(b, owner)
        block_ids = hits + [gpu.allocate(owner) for _ in range(new)]
        for i in range(len(hits), len(hashes)):
            gpu.register(block_ids[i], hashes[i])
        for i in range(len(hits), num_blocks):
            gpu.fill(block_ids[i], min(B, n - i * B))
        pending = list(prompt[len(hashes) * B:]) if prompt is not None else None
        seq = Sequence(op.seq_id, block_ids, n, GPU, op.namespace, last_hash, pending)
        self.seqs.add(seq)

        cached = len(hits) * B
        slots = self._slots(block_ids, 0, n)
        if prompt is not None:
            c = self.counters
            c.prefix_query_tokens += n
            c.prefix_hit_tokens += cached
            c.prefix_query_blocks += len(hashes)
            c.prefix_hit_blocks += len(hits)
        if self._step is not None:
            self._step.written.update(block_ids[len(hits):])
            self._step.computed.update(block_ids[len(hits):])
            self._step.touched[op.seq_id] = slots[cached:]
        return AllocateResult(op.seq_id, list(block_ids), slots, cached)

    def _append(self, op: AppendOp) -> AppendResult:
        seq = self._get_running(op.seq_id, "append to")
        tokens = op.token_ids or None
        k = self._count(tokens, op.num_tokens, "append")
        self._charge(2 * k, f"append to {quote(op.seq_id)}")
        slots, new_ids, copies = self._grow(seq, tokens, k)
        return AppendResult(op.seq_id, slots, new_ids, copies or BlockMapping(), seq.num_tokens)

    def _append_batch(self, op: AppendBatchOp) -> AppendBatchResult:
        """One token to each sequence, each append atomic on its own (all of them, if the step is
        all-or-nothing). The decode hot path: no per-append request or result objects, and the two
        common appends inline in this loop, no call per sequence:

        - in place (15 appends in 16 at block size 16): a running sequence below max_seq_len whose
          last block is partly filled and has no other reference (``_grow``'s fast path). No
          block is taken, nothing can fail. Consecutive such appends share one journal entry
          (``_undo_in_place``), recorded when the run starts, so before anything its appends
          record themselves (the hash of a block that fills): rollback order stays exact. The run
          holds the sequence itself for an append that only added a token (its undo takes it
          back), a full record (``_InPlace``) for one that filled its block or broke the hash chain;
        - into a new block (the last one is full), as ``_grow`` takes it (the same journal
          entries in the same order), when ``_grow``'s checks would pass: room in the pool, no
          quota check (``admit``) to run. It ends the run of in-place appends.

        Every other append (a copy-on-write, an error, a quota) is ``_grow``'s. The blocks written
        join the step's ``written``/``computed`` sets in one C-level update before each ``_grow``
        and at the end; the pool's fill count is updated once, at the end.

        O(1) per sequence (plus hashing a block that fills: O(block size)); O(new blocks) for
        one that takes a block through ``_grow``."""
        tokens = op.token_ids
        seq_ids = op.seq_ids
        if tokens is not None and len(tokens) != len(seq_ids):
            raise InvalidArgument(
                f"append batch: {len(tokens)} token ids for {len(seq_ids)} sequences; give one per sequence")
        if tokens is not None and tokens and min(tokens) < 0:
            raise InvalidArgument("append batch: token ids must be >= 0")
        result = AppendBatchResult()
        journal, grow, lookup, save, admit = self._journal, self._grow, self.seqs.getter(), self.seqs.save, self.admit
        gpu, owner_of = self.gpu, self.seqs.owner
        B, blocks, limit, register = self.block_size, gpu.blocks, self.config.max_seq_len, gpu.register
        step = self._step
        touched: dict[str, list[int]] = step.touched if step is not None else {}
        run: Optional[list[Sequence | _InPlace]] = None  # the current run of in-place appends (the journal holds it)
        written: list[int] = []  # last blocks appended to here, not yet in the step's sets
        filled = 0  # in-place appends: slots filled, added to the pool's count at the end
        entries = 0  # blocks added to tables here (not through ``_grow``), added to the table's count at the end
        try:
            for i, seq_id in enumerate(seq_ids):
                seq = lookup(seq_id)
                if seq is not None and seq.tier == GPU:
                    n = seq.num_tokens
                    offset = n % B
                    if offset and n < limit:
                        last = seq.block_ids[-1]
                        block = blocks[last]
                        if block.ref_count == 1:
                            if run is None:
                                run = []
                                journal.record(self._undo_in_place, run)
                            # Recorded first, then the counts changed (as its undo expects), then
                            # the hash state: the one part that may raise (a bug: the step rolls back).
                            pending = seq.pending_tokens
                            if pending is None:
                                run.append(seq)
                                block.num_filled += 1
                                filled += 1
                                seq.num_tokens = n + 1
                            elif tokens is not None and offset + 1 < B:
                                run.append(seq)
                                block.num_filled += 1
                                filled += 1
                                seq.num_tokens = n + 1
                                pending.append(tokens[i])
                            else:  # the block fills (register its hash) or the hash chain breaks
                                last_hash = seq.last_hash
                                run.append((seq, block, n, pending, len(pending), last_hash))
                                block.num_filled += 1
                                filled += 1
                                seq.num_tokens = n + 1
                                if tokens is None:
                                    seq.pending_tokens = seq.last_hash = None
                                elif last_hash is not None and len(pending) == B - 1:
                                    # ``_hash_new_tokens`` of one token that fills the block, inline
                                    pending.append(tokens[i])
                                    last_hash = chain_hash(last_hash, pending)
                                    register(last, last_hash)
                                    seq.last_hash, seq.pending_tokens = last_hash, []
                                else:  # not the state expected: the general code (raises on a bug)
                                    self._hash_new_tokens(seq, (tokens[i],), n)
                            written.append(last)
                            slots = touched.get(seq_id)
                            if slots is None:
                                touched[seq_id] = [last * B + offset]
                            else:
                                slots.append(last * B + offset)
                            continue
                    elif not offset and n < limit and admit is None and len(seq.block_ids) < gpu.num_usable \
                            and gpu.num_available:
                        # The last block is full: one new block, as ``_grow`` takes it (the same
                        # journal entries, in the same order; its room checks passed above).
                        run = None  # its entries come after the run's: a later in-place append starts a new run
                        save(seq)
                        last = gpu.allocate(owner_of(seq_id))
                        seq.block_ids.append(last)
                        entries += 1
                        gpu.fill(last, 1)
                        seq.num_tokens = n + 1
                        pending = seq.pending_tokens
                        if pending is not None:
                            if tokens is not None and B > 1 and seq.last_hash is not None:
                                pending.append(tokens[i])  # ``_hash_new_tokens``: the block is not full yet
                            else:
                                self._hash_new_tokens(seq, None if tokens is None else (tokens[i],), n)
                        written.append(last)
                        slots = touched.get(seq_id)
                        if slots is None:
                            touched[seq_id] = [last * B]
                        else:
                            slots.append(last * B)
                        continue
                run = None  # an in-place append after this one starts a new run, after this one's entries
                if written and step is not None:
                    step.written.update(written)
                    step.computed.update(written)
                    written.clear()
                mark = journal.mark()
                try:
                    if seq is None or seq.tier != GPU:
                        seq = self._get_running(seq_id, "append to")  # raises the precise error
                    grow(seq, None if tokens is None else (tokens[i],), 1)
                except InvariantViolation:
                    raise
                except ManagerError as err:
                    if self._all_or_nothing:
                        raise
                    journal.rollback_to(mark)
                    result.failures.append((i, err))
        finally:
            gpu.filled_slots += filled
            self.seqs.lengthened(entries)
        if written and step is not None:
            step.written.update(written)
            step.computed.update(written)
        return result

    def _undo_in_place(self, run: list[Sequence | _InPlace]) -> None:
        """Undo a run of in-place appends (``_append_batch``), newest first. A bare sequence took
        one token into its last block and, if it keeps pending tokens, one of those: both come
        back (the entries after it were undone first, so its last block and pending list are
        the ones it appended to). O(run)."""
        gpu = self.gpu
        blocks = gpu.blocks
        for item in reversed(run):
            if isinstance(item, tuple):
                seq, block, n, pending, pending_len, last_hash = item
                block.num_filled -= 1
                seq.num_tokens = n
                if pending is not None:
                    del pending[pending_len:]
                seq.pending_tokens = pending
                seq.last_hash = last_hash
            else:
                blocks[item.block_ids[-1]].num_filled -= 1
                item.num_tokens -= 1
                if item.pending_tokens is not None:
                    item.pending_tokens.pop()
        gpu.filled_slots -= len(run)

    def _grow(self, seq: Sequence, tokens: Optional[Seq[int]], k: int
              ) -> tuple[list[int], list[int], Optional[BlockMapping]]:
        """Add k tokens to a running sequence: check room, then copy a shared partial last block
        (copy-on-write) and take new blocks. Returns the new tokens' slots, the blocks added and
        the copy (None when there is none). O(k + new blocks)."""
        n, B, gpu = seq.num_tokens, self.block_size, self.gpu
        seq_id = seq.seq_id
        offset = n % B
        if k == 1 and offset and gpu.blocks[seq.block_ids[-1]].ref_count == 1 and n < self.config.max_seq_len:
            slot = self._grow_in_place(seq, None if tokens is None else tokens[0], n, offset)
            return [slot], [], None
        if n + k > self.config.max_seq_len:
            raise InvalidArgument(
                f"append to {quote(seq_id)}: {n} + {k} tokens exceeds max_seq_len {self.config.max_seq_len}")
        table = seq.block_ids
        total = ceil_div(n + k, B)
        if total > gpu.num_usable:
            raise OutOfRange(f"append to {quote(seq_id)}: {n + k} tokens need {total} blocks; the GPU pool has "
                             f"{gpu.num_usable}")
        step = self._step
        cow = n % B != 0 and gpu.blocks[table[-1]].ref_count > 1
        if cow and step is not None and table[-1] in step.computed:
            raise FailedPrecondition(
                f"append to {quote(seq_id)}: its last block is shared and gets K/V in this step; copy-on-write "
                f"would copy it before it is written; append in a later step")
        need = total - len(table) + cow
        if need > gpu.num_available:
            raise ResourceExhausted(
                f"append to {quote(seq_id)}: needs {need} free GPU blocks, {gpu.num_available} are free or evictable",
                needed=need, free=gpu.num_available)
        if self.admit is not None and need:
            self.admit(f"append to {quote(seq_id)}", need)

        self.seqs.save(seq)
        owner = self.seqs.owner(seq_id)
        copies: Optional[BlockMapping] = None
        new_ids: list[int] = []
        if cow:
            copies = BlockMapping()
            shared = table[-1]
            private = gpu.allocate(owner)
            gpu.fill(private, n % B)
            copies.add(shared, private)
            table[-1] = private
            gpu.decref(shared)
            new_ids.append(private)
            self.counters.cow_copies += 1
        if total > len(table):
            self.seqs.lengthened(total - len(table))
        while len(table) < total:
            bid = gpu.allocate(owner)
            table.append(bid)
            new_ids.append(bid)
        first = n // B
        for i in range(first, total):
            gpu.fill(table[i], min(B, n + k - i * B))
        seq.num_tokens = n + k
        self._hash_new_tokens(seq, tokens, n)

        slots = self._slots(table, n, n + k)
        if step is not None:
            if copies is not None:
                step.plan.blocks_to_copy.extend(copies)
            for i in range(first, total):
                step.written.add(table[i])
                step.computed.add(table[i])
            step.touched.setdefault(seq_id, []).extend(slots)
        return slots, new_ids, copies

    def _grow_in_place(self, seq: Sequence, token: Optional[int], n: int, offset: int) -> int:
        """The common decode case of ``_grow``: one token into a private, partly filled last block.
        No block is taken and nothing is copied, so nothing can fail; one journal entry undoes it.
        Returns the token's slot."""
        last = seq.block_ids[-1]
        pending = seq.pending_tokens
        self._journal.record(self._undo_grow_in_place, seq, last, n, pending,
                             0 if pending is None else len(pending), seq.last_hash)
        self.gpu.add_filled(last, 1)
        seq.num_tokens = n + 1
        if pending is not None:
            if token is None:
                seq.pending_tokens = seq.last_hash = None
            elif offset + 1 < self.block_size:
                pending.append(token)
            else:
                self._hash_new_tokens(seq, (token,), n)  # the block is full now: register its hash
        slot = last * self.block_size + offset
        step = self._step
        if step is not None:
            step.written.add(last)
            step.computed.add(last)
            touched = step.touched.get(seq.seq_id)
            if touched is None:
                step.touched[seq.seq_id] = [slot]
            else:
                touched.append(slot)
        return slot

    def _undo_grow_in_place(self, seq: Sequence, last: int, n: int, pending: Optional[list[int]],
                            pending_len: int, last_hash: Optional[bytes]) -> None:
        self.gpu.add_filled(last, -1)
        seq.num_tokens = n
        if pending is not None:
            del pending[pending_len:]
        seq.pending_tokens = pending
        seq.last_hash = last_hash

    def _fork(self, op: ForkOp) -> ForkResult:
        parent = self._get_running(op.parent_seq_id, "fork")
        self._check_new_id(op.child_seq_id)
        # The answer holds the child's table once in the result and once per table layout of the batch.
        what = f"fork {quote(op.parent_seq_id)} -> {quote(op.child_seq_id)}"
        self._admit_sequence(what, len(parent.block_ids))
        self._charge((1 + self._table_copies()) * len(parent.block_ids), what)
        for b in parent.block_ids:
            self.gpu.incref(b)
        pending = list(parent.pending_tokens) if parent.pending_tokens is not None else None
        child = Sequence(op.child_seq_id, list(parent.block_ids), parent.num_tokens, GPU,
                         parent.namespace, parent.last_hash, pending)
        self.seqs.add(child)
        if self._step is not None:
            self._step.touched.setdefault(op.child_seq_id, [])
        return ForkResult(op.child_seq_id, list(child.block_ids))

    def _free(self, op: FreeOp) -> FreeResult:
        if op.seq_id in self.lost and op.seq_id not in self.seqs:  # its blocks went with the lost workers
            self._journal.record(self.lost.__setitem__, op.seq_id, self.lost.pop(op.seq_id))
            return FreeResult(op.seq_id, 0)
        seq = self._get(op.seq_id)
        if self._step is not None and self._step.touched.get(op.seq_id):
            # Its tokens would not be computed, yet a fork or a prefix hit may share their blocks.
            raise FailedPrecondition(
                f"free: sequence {quote(op.seq_id)} has tokens to compute in this step; free it in a later step")
        pool = self.gpu if seq.tier == GPU else self.cpu
        released = 0
        for b in reversed(seq.block_ids):  # tail first, so the LRU evicts a prefix's tail first
            released += pool.decref(b)
        self.seqs.remove(seq)
        if self._step is not None:
            self._step.touched.pop(op.seq_id, None)
        return FreeResult(op.seq_id, released)

    def _hash_new_tokens(self, seq: Sequence, tokens: Optional[Seq[int]], start: int) -> None:
        """Extend the prefix-hash chain over appended tokens, registering blocks they fill."""
        pending, last_hash = seq.pending_tokens, seq.last_hash
        if pending is None:
            return
        if last_hash is None:
            raise InvariantViolation(f"sequence {quote(seq.seq_id)} has pending tokens but no prefix hash")
        if tokens is None:  # an unknown token breaks the chain for good
            seq.pending_tokens = seq.last_hash = None
            return
        B = self.block_size
        pending.extend(tokens)  # only ever extended in place, so the journal restores it by truncation
        if len(pending) < B:
            return
        full, i = start // B, 0
        while len(pending) - i >= B:
            last_hash = chain_hash(last_hash, pending[i:i + B])
            self.gpu.register(seq.block_ids[full], last_hash)
            i += B
            full += 1
        seq.last_hash, seq.pending_tokens = last_hash, pending[i:]

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        B = self.block_size
        if end - start == 1:
            return [table[start // B] * B + start % B]
        return [table[i // B] * B + i % B for i in range(start, end)]
