"""Which worker caches the manager's state lives in, and the epoch: how many times they were lost.

Each worker process picks a random cache id when it starts and sends it with RegisterWorker. A
rank that registers again with the same id (after a manager restart, after it was dropped for
missed heartbeats) still holds its cache: the recovered state is served as it was. A rank that
comes back with another id restarted and lost its cache, and with one rank's cache every
sequence's K/V is gone (each sequence lives on every tensor-parallel rank): a new epoch begins,
the manager marks every sequence lost (``BlockManager.lose_all``: operations on them answer
DATA_LOSS until freed) and forgets the prefix cache. The other ranks of a replaced group, coming
back with new ids too, join the new epoch without starting another, unless the manager made
state since it began (a live sequence, or a cached prefix block: their K/V lives in that rank's
old cache too), which their return loses: then another epoch begins. GetStats shows the epoch.

A cache id a rank had before its current one is *superseded*: its process was replaced by a newer
one (which holds the rank's part of every sequence made since), so what that cache holds is
stale. Such a process coming back (a "zombie": its heartbeats stopped, then resumed) is refused
FAILED_PRECONDITION (``check``) before anything changes, instead of taking the rank back, which
would start yet another epoch, lose every sequence, and make the live process's next
registration do the same. The current id coming back is still welcome, whatever the epoch: no
plan runs while a rank is missing, so its cache missed none. The superseded ids are logged as the
registrations are (``worker_cache`` events, ``manager/recovery.py``) and kept in snapshots, so a
restarted manager refuses them too.

A worker that sends no cache id (an older worker) is not tracked: its re-registration only
clears the prefix cache, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from kvpager.errors import FailedPrecondition, quote

if TYPE_CHECKING:
    from .block_manager import BlockManager


def holds_state(manager: Optional["BlockManager"]) -> bool:
    """Whether the workers' caches hold anything of the manager's: a live sequence (running or
    swapped) or a cached prefix block. O(1)."""
    return manager is not None and (len(manager.seqs) > 0 or manager.gpu.num_cached > 0)


class WorkerCaches:
    SUPERSEDED_KEPT = 256  # superseded cache ids remembered per rank, the newest; older ones are forgotten

    def __init__(self) -> None:
        self.epoch = 0
        self.ranks: dict[int, tuple[str, int]] = {}  # rank -> (cache id, epoch it was registered in)
        # rank -> {superseded cache id: the epoch current when a newer process's id replaced it},
        # oldest first (a dict keeps the order: forgetting the oldest is O(1)). Changed by register.
        self.superseded: dict[int, dict[str, int]] = {}

    def check(self, rank: int, cache_id: str) -> None:
        """Refuse (FailedPrecondition) a registration of ``rank`` with a superseded cache id. O(1)."""
        epoch = self.superseded.get(rank, {}).get(cache_id) if cache_id else None
        if epoch is not None:
            raise FailedPrecondition(
                f"register worker: rank {rank}'s cache {quote(cache_id)} was superseded (a newer worker process took "
                f"rank {rank} with another cache, epoch {epoch}), so what it holds is stale: stop this worker; to "
                "have it replace the rank's current process instead, restart it (a fresh cache)")

    def register(self, rank: int, cache_id: str, holds_state: bool = False) -> bool:
        """Record rank's cache; True when it shows the caches were lost (a new epoch began).
        ``holds_state``: the manager has live sequences or cached prefix blocks, made since the
        current epoch began if it lost everything then (``lose_all``)."""
        if not cache_id:
            return False
        known = self.ranks.get(rank)
        lost = known is not None and known[0] != cache_id and (known[1] == self.epoch or holds_state)
        if lost:
            self.epoch += 1
        if known is not None and known[0] != cache_id:
            superseded = self.superseded.setdefault(rank, {})
            superseded.pop(cache_id, None)  # only a log written before ``check`` existed brings one back
            superseded[known[0]] = self.epoch
            if len(superseded) > self.SUPERSEDED_KEPT:
                del superseded[next(iter(superseded))]
        self.ranks[rank] = (cache_id, self.epoch)
        return lost

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "ranks": dict(self.ranks),
                "superseded": {rank: dict(ids) for rank, ids in self.superseded.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.ranks = dict(state["ranks"])
        # A snapshot written before superseded ids were kept has none.
        self.superseded = {rank: dict(ids) for rank, ids in state.get("superseded", {}).items()}
