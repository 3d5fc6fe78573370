"""The scheduler's counters: what its steps computed, sent and recovered from (``Scheduler.stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    tokens_computed: int = 0       # prompt + decode tokens the model ran
    tokens_generated: int = 0
    requests_finished: int = 0
    preemptions: int = 0           # groups swapped out
    restarts: int = 0              # groups freed and recomputed (no CPU room, or workers lost)
    recoveries: int = 0            # times workers were lost and the live requests restarted
    overlapped_steps: int = 0      # Step RPCs sent while the previous step computed (overlap)
    fed_steps: int = 0             # steps sent before the previous one's tokens came back (overlap)
    step_latencies: list[float] = field(default_factory=list)  # Step RPC round trips, seconds
