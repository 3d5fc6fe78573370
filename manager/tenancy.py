"""Tenants: every id a client names lives in its tenant's space (docs/security.md, "Tenants").

The service maps a caller's ids to internal keys when it decodes a request and maps them back
when it encodes the answer, so the ``BlockManager`` (and whatever records its operations) works
on plain strings that are unique across tenants:

- tenant ``""`` (every caller of a server without tokens): an id is its own key, so such a
  server behaves exactly as without tenants (an id starting with NUL gets one more NUL in front);
- tenant ``t``: the key is ``"\\0" + t + "\\0" + id``.

A tenant name never holds NUL (``kvpager.auth`` refuses one), so the mapping is one to one:
another tenant's sequence is simply absent from a caller's space, and naming it answers
exactly what naming a missing id answers. The empty id stays empty in every space (the manager
refuses it the same way for everyone). Prefix-cache namespaces map the same way, the empty
namespace included, so the hash chains of two tenants never share a root
(``manager/prefix_hash.py``). Request ids map the same way (the request-id cache is keyed by
them). Error messages quote internal keys (``errors.quote``); ``Scope.message`` rewrites each
quote of a key the request named into the quote of the caller's id.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence as Seq, TypeVar

from google.protobuf.message import Message

from kvpager.errors import ManagerError, ResourceExhausted, quote
from .operations import (
    AllocateOp, AppendBatchOp, AppendOp, ForkOp, FreeOp, Operation, SwapInOp, SwapOutOp, op_ids,
)
from .sequence import GPU

SEP = "\0"
MessageT = TypeVar("MessageT", bound=Message)  # a response message, rewritten in place

if TYPE_CHECKING:
    from .block_manager import BlockManager


def qualify(tenant: str, name: str) -> str:
    """The internal key of ``tenant``'s id ``name`` (``""`` stays ``""``)."""
    if not name:
        return name
    if not tenant:
        return SEP + name if name[0] == SEP else name
    return SEP + tenant + SEP + name


def qualify_namespace(tenant: str, namespace: str) -> str:
    """The internal prefix-cache namespace of ``tenant``'s ``namespace`` (the empty one included)."""
    if not tenant:
        return SEP + namespace if namespace[:1] == SEP else namespace
    return SEP + tenant + SEP + namespace


def unqualify(key: str) -> tuple[str, str]:
    """(tenant, id) of an internal key."""
    if key[:1] != SEP:
        return "", key
    if key[1:2] == SEP:
        return "", key[1:]
    end = key.index(SEP, 1)
    return key[1:end], key[end + 1:]


def tenant_of(key: str) -> str:
    return unqualify(key)[0] if key[:1] == SEP else ""


def client_len(key: str) -> int:
    """Characters of the id a client gave for ``key`` (the manager's length limits apply to it)."""
    return len(key) if key[:1] != SEP else len(unqualify(key)[1])


# Every id of an operation (and an Allocate's namespace) as one string, to look for NUL in one scan.
_ID_TEXT: dict[type[Operation], Callable[[Any], str]] = {  # each takes its own operation type
    AllocateOp: lambda op: op.seq_id + op.namespace, AppendOp: lambda op: op.seq_id, FreeOp: lambda op: op.seq_id,
    ForkOp: lambda op: op.parent_seq_id + op.child_seq_id, AppendBatchOp: lambda op: "".join(op.seq_ids),
    SwapOutOp: lambda op: "".join(op.seq_ids), SwapInOp: lambda op: "".join(op.seq_ids),
}


# How each operation is mapped to a tenant's keys.
_REMAP: dict[type[Operation], Callable[[Scope, Any], Operation]] = {  # each takes its own operation type
    AllocateOp: lambda s, op: AllocateOp(s.key(op.seq_id), op.token_ids, op.num_tokens,
                                         qualify_namespace(s.tenant, op.namespace)),
    AppendOp: lambda s, op: AppendOp(s.key(op.seq_id), op.token_ids, op.num_tokens),
    AppendBatchOp: lambda s, op: AppendBatchOp(s._keys(op.seq_ids), op.token_ids),
    ForkOp: lambda s, op: ForkOp(s.key(op.parent_seq_id), s.key(op.child_seq_id)),
    FreeOp: lambda s, op: FreeOp(s.key(op.seq_id)),
    SwapOutOp: lambda s, op: SwapOutOp(s._keys(op.seq_ids)),
    SwapInOp: lambda s, op: SwapInOp(s._keys(op.seq_ids)),
}


class Scope:
    """One caller's tenant: maps its ids to keys and the manager's answers back to its ids."""

    __slots__ = ("tenant", "mapped", "_prefix")

    def __init__(self, tenant: str = "") -> None:
        self.tenant: str = tenant
        # Whether a key differs from its id (always, but for tenant "" and no id starting with NUL):
        # when not, answers need no rewriting (a server without tokens pays nothing per id).
        self.mapped = bool(tenant)
        self._prefix = SEP + tenant + SEP

    def key(self, name: str) -> str:
        if self.tenant:
            return self._prefix + name if name else name
        if name[:1] != SEP:
            return name
        self.mapped = True
        return SEP + name

    def name(self, key: str) -> str:
        return unqualify(key)[1] if key[:1] == SEP else key

    def _keys(self, names: Seq[str]) -> Seq[str]:
        if not self.tenant:
            if not any(n[:1] == SEP for n in names):
                return names
            self.mapped = True
            return [qualify("", n) for n in names]
        prefix = self._prefix
        return [prefix + n if n else n for n in names]

    def op(self, op: Operation) -> Operation:
        """``op`` with every id (and the namespace) mapped to this tenant's keys."""
        if not self.tenant:
            text = _ID_TEXT.get(type(op))
            if text is None or SEP not in text(op):
                return op  # tenant "": every id without NUL is its own key (one C-level scan)
        remap = _REMAP.get(type(op))
        return op if remap is None else remap(self, op)

    def ops(self, ops: list[Operation]) -> list[Operation]:
        return list(map(self.op, ops))

    # ---- answers ----------------------------------------------------------------------------
    def message(self, text: str, keys: Iterable[str]) -> str:
        """``text`` with each quote of one of ``keys`` replaced by the quote of the caller's id."""
        if not self.mapped:
            return text
        for key in keys:
            if key[:1] == SEP:
                text = text.replace(quote(key), quote(self.name(key)))
        return text

    def error(self, err: ManagerError, keys: Iterable[str]) -> ManagerError:
        text = str(err)
        shown = self.message(text, keys)
        if shown == text:
            return err
        out = type(err)(shown)
        out.__dict__.update(err.__dict__)  # what the error carries besides its message (blocks needed, free...)
        out.__cause__ = err.__cause__
        return out

    def op_error(self, err: ManagerError, op: Operation) -> ManagerError:
        return self.error(err, op_ids(op))

    def response(self, reply: MessageT, ops: Optional[list[Operation]] = None) -> MessageT:
        """The reply of a single operation, a Step or GetBlockTable with the caller's ids (in place)."""
        if not self.mapped:
            return reply
        for field in ("seq_id", "child_seq_id"):
            if hasattr(reply, field) and getattr(reply, field):
                setattr(reply, field, self.name(getattr(reply, field)))
        if ops is not None:  # a StepResponse
            batch = reply.batch
            if any(s[:1] == SEP for s in batch.seq_ids):
                names = [self.name(s) for s in batch.seq_ids]
                del batch.seq_ids[:]
                batch.seq_ids.extend(names)
            for op, res in zip(ops, reply.results):
                kind = res.WhichOneof("result")
                if kind is not None:
                    inner = getattr(res, kind)
                    for field in ("seq_id", "child_seq_id"):
                        if hasattr(inner, field) and getattr(inner, field):
                            setattr(inner, field, self.name(getattr(inner, field)))
                    if kind == "append_batch" and isinstance(op, AppendBatchOp) and inner.failed_messages:
                        messages = [self.message(m, [op.seq_ids[i]])
                                    for i, m in zip(inner.failed_indices, inner.failed_messages)]
                        del inner.failed_messages[:]
                        inner.failed_messages.extend(messages)
                if res.message:
                    res.message = self.message(res.message, op_ids(op))
        return reply


# ---- usage and quotas ----------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class Usage:
    """What one tenant's live sequences hold (blocks counted once however many sequences share them)."""

    gpu_blocks: int = 0
    cpu_blocks: int = 0
    running_sequences: int = 0
    swapped_sequences: int = 0

    @property
    def blocks(self) -> int:
        return self.gpu_blocks + self.cpu_blocks


def usage(manager: BlockManager, tenant: Optional[str] = None) -> dict[str, Usage]:
    """Tenant -> usage, for every tenant with a live sequence (only ``tenant`` when given).
    O(sequences + their blocks): for GetStats and the invariant checker, never a Step (the pools
    count each tenant's blocks in O(1): ``BlockPool.owned``). No block is held by two tenants:
    sequences share blocks only through forks and the prefix cache, both within a tenant's space."""
    blocks: dict[str, tuple[set[int], set[int]]] = defaultdict(lambda: (set(), set()))
    out: dict[str, Usage] = {}
    for seq in manager.seqs.values():
        owner = tenant_of(seq.seq_id)
        if tenant is not None and owner != tenant:
            continue
        u = out.get(owner)
        if u is None:
            u = out[owner] = Usage()
        gpu, cpu = blocks[owner]
        if seq.tier == GPU:
            u.running_sequences += 1
            gpu.update(seq.block_ids)
        else:
            u.swapped_sequences += 1
            cpu.update(seq.block_ids)
    for owner, u in out.items():
        gpu, cpu = blocks[owner]
        u.gpu_blocks, u.cpu_blocks = len(gpu), len(cpu)
    return out


class QuotaCheck:
    """Enforces one tenant's quota of GPU blocks during one step (``BlockManager.admit``): an
    operation about to take more GPU blocks than the quota leaves is refused RESOURCE_EXHAUSTED
    before it changes anything. O(1), to build and per call: the GPU pool counts the blocks each
    tenant's tables name as they change (``BlockPool.owned``, what ``usage`` recounts). Before it
    did, building one walked every live sequence: 130 to 190 ms with 100,000 of them (a shared
    2-core machine), paid by every Step of a tenant with a quota."""

    def __init__(self, manager: BlockManager, tenant: str, quota: int) -> None:
        self.manager, self.tenant, self.quota = manager, tenant, quota

    def __call__(self, what: str, blocks: int) -> None:
        if blocks <= 0:
            return
        held = self.manager.gpu.owned_by(self.tenant)
        if held + blocks > self.quota:
            raise ResourceExhausted(
                f"{what}: needs {blocks} more GPU blocks; tenant {self.tenant!r} holds {held} of its quota of "
                f"{self.quota} (quota_blocks)", needed=blocks, free=max(0, self.quota - held))


class SequenceQuotaCheck:
    """Enforces one tenant's quota of live sequences during one step (``BlockManager.admit_sequence``):
    an allocate or fork that would give the tenant one more than its quota is refused
    RESOURCE_EXHAUSTED before it changes anything, so that one tenant cannot take every sequence
    (``max_sequences``) or the manager's memory from the others. O(1): the sequence table counts
    each tenant's live sequences (running and swapped out; lost ones are not live)."""

    def __init__(self, manager: BlockManager, tenant: str, quota: int) -> None:
        self.manager, self.tenant, self.quota = manager, tenant, quota

    def __call__(self, what: str) -> None:
        held = self.manager.seqs.owned_by(self.tenant)
        if held >= self.quota:
            raise ResourceExhausted(
                f"{what}: tenant {self.tenant!r} holds {held} live sequences, its quota of {self.quota} "
                "(quota_sequences); free sequences first")
