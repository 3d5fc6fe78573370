"""The scheduler's request queues and its admission and preemption policy.

A request is a ``Group`` of sequences (its prompt and, with ``n > 1``, samples forked from it)
that waits, runs or is swapped out. Each step, swapped groups come back in first, oldest first,
as the GPU room allows; waiting requests are admitted, in order, only while no group is swapped
out, each taking its prompt's blocks and one block per forked sample, within the step's token
budget (``max_batch_tokens``; a prompt longer than the budget is admitted alone). The room is
what the manager last reported available, less its watermark reserve and the running groups'
next appends. When those appends would not fit, or the last Step refused some (a tenant's quota
is only seen there), the most recently admitted group is preempted:
swapped out in a step of its own first (blocks freed in a step are only reusable after it),
or, when the CPU pool is full too, freed and queued again at the front to restart from scratch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Callable, Optional

import torch

from kvpager import client as C
from kvpager import errors
from kvpager.numeric import ceil_div
from kvpager.v1 import block_manager_pb2 as pb

from .request import Group, Request, SeqState

# Told an operation's result in a Step's reply, and its error (None when it succeeded).
ResultHandler = Callable[[pb.OperationResult, Optional[errors.ManagerError]], None]
# Adds an operation to the Step being built, with the handler of its result (None: any error raises).
AddOperation = Callable[[pb.Operation, Optional[ResultHandler]], None]
# Sends one Step with these operations and returns its reply.
SendStep = Callable[[list[pb.Operation]], pb.StepResponse]


class RequestQueues:
    """The waiting, running and swapped groups, the sequences by id, and the GPU blocks left.
    Changed by the scheduler's one loop only."""

    def __init__(self, block_size: int, max_batch_tokens: int, available: int, reserve: int) -> None:
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens   # prompt tokens one step admits (the first at any length)
        self.waiting: deque[Group] = deque()
        self.running: list[Group] = []             # admission order: the last is preempted first
        self.swapped: deque[Group] = deque()
        self.on_wire: list[Group] = []             # groups out of every queue while a Step is on the wire
        self.to_free: list[SeqState] = []          # finished sequences the next Step frees
        self.seqs: dict[str, SeqState] = {}
        self.group_of: dict[str, Group] = {}       # by sequence id
        self.available = available                 # GPU blocks free or evictable, as the last Step reported
        self.reserve = reserve                     # the manager's watermark
        self.appends_refused = False               # the last Step refused appends for room (pool or quota)

    def new_group(self, request: Request, previous: Optional[Group] = None) -> Group:
        """The request's sequences, from its prompt; ``previous``: the group it restarts, whose
        streamed tokens are not streamed again."""
        params = request.params
        group = Group(request)
        for i in range(params.n):
            seq_id = request.request_id if i == 0 else f"{request.request_id}#{i}"
            generator = None
            if params.temperature > 0:
                generator = torch.Generator().manual_seed((params.seed or 0) * 1000003 + i)
            streamed, finish_streamed = 0, False
            if previous is not None:
                old = previous.seqs[i]
                streamed = max(old.streamed, old.num_generated)
                finish_streamed = old.finish_streamed or bool(old.finish_reason)
            seq = SeqState(seq_id, list(request.prompt), generator=generator, streamed=streamed,
                           finish_streamed=finish_streamed)
            group.seqs.append(seq)
            self.seqs[seq_id] = seq
        for seq in group.seqs:
            self.group_of[seq.seq_id] = group
        return group

    # ---- swap-ins and admissions ---------------------------------------------------------------------
    def schedule(self, add: AddOperation, swap_in: bool) -> None:
        """Add this step's swap-ins (when ``swap_in``) and admissions to the Step being built;
        their groups are ``on_wire`` until its reply's handlers place them."""
        room = self.room()
        if swap_in:
            room = self._swap_in(add, room)
        budget = self.max_batch_tokens
        while self.waiting and not self.swapped:
            group = self.waiting[0]
            prompt, n = group.request.prompt, group.request.params.n
            need = ceil_div(len(prompt), self.block_size) + (n - 1)
            if need > room or (len(prompt) > budget and budget < self.max_batch_tokens):
                break
            self.waiting.popleft()
            self.on_wire.append(group)
            room, budget = room - need, budget - len(prompt)
            parent = group.seqs[0]
            add(C.allocate_op(parent.seq_id, prompt, namespace=group.request.namespace),
                self._placed(group, self.waiting))
            for child in group.seqs[1:]:
                add(C.fork_op(parent.seq_id, child.seq_id), self._forked(group))

    def _swap_in(self, add: AddOperation, room: int) -> int:
        """Swap-ins of the oldest swapped groups that fit in ``room``; the room left."""
        while self.swapped and self.blocks(self.swapped[0]) <= room:
            group = self.swapped.popleft()
            self.on_wire.append(group)
            room -= self.blocks(group)
            add(C.swap_in_op([s.seq_id for s in group.unfinished()]), self._placed(group, self.swapped))
        return room

    def _placed(self, group: Group, retry: deque[Group]) -> ResultHandler:
        """The handler of a group's admission or swap-in: running once the manager placed it; back
        at the front of ``retry`` (the waiting or the swapped queue) when it found no room."""
        def handle(result: pb.OperationResult, err: Optional[errors.ManagerError]) -> None:
            if err is None:
                self.running.append(group)
            elif isinstance(err, errors.ResourceExhausted):
                retry.appendleft(group)  # try again when room returns
            else:
                raise err
        return handle

    def _forked(self, group: Group) -> ResultHandler:
        """The handler of a sample's fork from its group's new prompt: NOT_FOUND is expected when
        the prompt's admission found no room (the group waits again); any other failure raises."""
        def handle(result: pb.OperationResult, err: Optional[errors.ManagerError]) -> None:
            if err is not None and not (isinstance(err, errors.NotFound) and group in self.waiting):
                raise err
        return handle

    def swap_in_fits(self) -> bool:
        """Whether the oldest swapped group has room to come back in this step."""
        return bool(self.swapped) and self.blocks(self.swapped[0]) <= self.room()

    # ---- preemption ------------------------------------------------------------------------------------
    def short(self) -> bool:
        """The running groups' next appends may not fit (by the pool's room, or the last Step
        refused some: a tenant's quota counts only there), and one of them can make room by leaving."""
        return (self.appends_refused or self.append_need() > self.available) and len(self.running) > 1

    def preempt(self, send: SendStep) -> bool:
        """Swap the most recently admitted running group out in a Step of its own (``send``);
        when the CPU pool has no room for it, free it and queue its request again at the front
        of ``waiting``, to restart from scratch. Whether it was swapped out (else restarted)."""
        victim = self.running.pop()
        self.appends_refused = False   # one group leaves; the next Step tells whether that was enough
        live = victim.unfinished()
        self.on_wire.append(victim)   # until it is placed again: a Step failing meanwhile finds it there
        reply = send([C.swap_out_op([s.seq_id for s in live])])
        err = C.result_error(reply.results[0])
        if err is None:
            self.on_wire.clear()
            self.swapped.append(victim)
            return True
        if not isinstance(err, (errors.ResourceExhausted, errors.OutOfRange)):
            raise err
        finished = [s for s in self.to_free if s in victim.seqs]
        send([C.free_op(s.seq_id) for s in live + finished])  # no CPU room: recompute later
        self.to_free = [s for s in self.to_free if s not in victim.seqs]
        self.on_wire.clear()
        self.waiting.appendleft(self.new_group(victim.request, victim))
        return False

    def restart_all(self, send: SendStep, answered: Mapping[str, object]) -> int:
        """Free every sequence the manager may hold for us (one Step, ``send``) and queue each
        request not ``answered`` (by request id) again from scratch, ahead of the waiting ones;
        how many were queued again. For workers lost with the K/V of every live sequence."""
        # Every group the manager may hold: running, swapped, and those a failed Step carried
        # (an admission the manager never applied frees as NOT_FOUND, which is fine).
        groups = list(dict.fromkeys([*self.on_wire, *self.running, *self.swapped]))
        seq_ids = [s.seq_id for g in groups for s in g.seqs] + [s.seq_id for s in self.to_free]
        reply = send([C.free_op(i) for i in dict.fromkeys(seq_ids)])
        for result in reply.results:
            err = C.result_error(result)
            if err is not None and not isinstance(err, errors.NotFound):
                raise err
        unfinished = [g for g in groups if g.request.request_id not in answered]
        self.waiting.extendleft(self.new_group(g.request, g) for g in reversed(unfinished))
        self.running.clear()
        self.swapped.clear()
        self.to_free.clear()
        self.on_wire.clear()
        self.appends_refused = False
        return len(unfinished)

    # ---- GPU blocks ------------------------------------------------------------------------------------
    def room(self) -> int:
        """GPU blocks this step may still give to swap-ins and admissions: those free or evictable
        above the manager's watermark reserve (its admission check, ``manager/state.py`` ``_admit``,
        mirrored so that a step asks only for what it will be given), after the running groups'
        next appends. The one place the scheduler applies the watermark. O(running groups)."""
        return self.available - self.reserve - self.append_need()

    def append_need(self) -> int:
        """Blocks the next appends may take: a new block at each block boundary, and a
        copy-on-write block for samples that may still share a partial last block."""
        need, B = 0, self.block_size
        for group in self.running:
            seqs = group.seqs
            if len(seqs) == 1:   # the common case, without building a list
                need += not seqs[0].finish_reason and seqs[0].num_cached % B == 0
                continue
            live = group.unfinished()
            if len(live) == 1:
                need += live[0].num_cached % B == 0
            else:
                need += len(live)
        return need

    def blocks(self, group: Group) -> int:
        """GPU blocks the group's live samples hold once swapped back in, with room for their next
        token. Samples forked from one prompt share its full blocks: counted once."""
        B = self.block_size
        shared = len(group.request.prompt) // B if len(group.seqs) > 1 else 0
        return shared + sum(ceil_div(s.num_cached + 1, B) - shared for s in group.unfinished())
