"""Prometheus metrics of one cache worker (the "Worker" table of docs/metrics.md).

Each worker owns its own registry, never prometheus-client's global one: several workers can
live in one process (tests, the in-process demo) and their series must not mix.

What the worker's state already says is set once (cache sizes, who the worker is) or read at
scrape time (the allocator's device memory: ``Gauge.set_function``) instead of being kept up to
date by hand; what happens (plans, steps, bytes moved, durations) is counted where it happens.

Durations of device work are the subtle part. On the CPU a plan or an attention call has
finished when it returns, so it is timed with ``perf_counter``. On CUDA it has only been
ENQUEUED (a plan on the cache's swap stream, attention on the compute stream), and waiting
for it would cost the very overlap the streams exist for; so each interval is a pair of
timing events recorded on the stream that runs the work, and its length is read once the
GPU has passed the end event: ``DeviceClock.poll`` collects the finished ones at the next
plan, the next model step and every scrape, never making the host wait (except to keep the
backlog bounded, which a working scheduler never reaches: each step's logits sync anyway).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional, Union

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.core import Metric

from .block_plan import BlockPlan
from .kv_cache import KVCache

# The parts of a plan, in the order the cache runs them, and the copy direction of each.
PLAN_KINDS = ("swap_out", "swap_in", "copy")
DIRECTIONS = {"swap_out": "gpu_to_cpu", "swap_in": "cpu_to_gpu", "copy": "gpu_to_gpu"}

# A plan part or one step's attention: a few blocks or tokens take microseconds, a swap of
# gigabytes over PCIe seconds. A model step: a tiny decode batch to a long prefill on a CPU.
DEVICE_WORK_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                       0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MODEL_STEP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                      5.0, 10.0, 30.0)

Observe = Callable[[float], None]       # takes seconds (a histogram's observe)
Mark = Union[float, "torch.cuda.Event"]  # a point in time: perf_counter() or a recorded CUDA event


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """The labels of ``kvpager_worker_info``: what stays the same for the life of the worker.
    (Not the manager's worker id: a new one at each registration would make a new series each time.)"""

    rank: int
    tensor_parallel_size: int
    device: str
    attention_backend: str   # "cuda" or "reference" (ops.backend of the cache)
    kv_cache_dtype: str      # the cache's storage dtype, e.g. "float16", "float8_e4m3fn"

    def labels(self) -> dict[str, str]:
        return {name: str(value) for name, value in asdict(self).items()}


class DeviceClock:
    """Times intervals of work on one device without making the host wait for the device.

    ``span(observe)`` returns a ``Span``; every ``with span:`` adds an interval, and
    ``span.submit()`` hands their sum to ``observe`` (seconds): at once on the CPU, once the
    last end event has completed on CUDA (``poll``). Events are recycled: creating CUDA
    events on every step would cost more than recording them. A span's events all go to the
    stream that was current at its first interval: looking the stream up costs more than
    recording an event, and one stream per span is what makes "last done" mean "all done".
    """

    MAX_PENDING = 1024  # spans waiting for the GPU; past this the oldest is waited for

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self._lock = threading.Lock()
        self._pending: list[tuple[list[torch.cuda.Event], Observe]] = []
        self._spare: list[torch.cuda.Event] = []

    def span(self, observe: Observe) -> "Span":
        return Span(self, observe)

    def current_stream(self) -> "torch.cuda.Stream | None":
        """The device's current stream (None on the CPU)."""
        return torch.cuda.current_stream(self.device) if self.on_cuda else None

    def mark(self, stream: "torch.cuda.Stream | None") -> Mark:
        """Now: on the host (CPU), or where ``stream`` has got to (CUDA)."""
        if not self.on_cuda:
            return time.perf_counter()
        try:
            event = self._spare.pop()  # atomic under the GIL
        except IndexError:
            event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def submit(self, marks: list[Mark], observe: Observe) -> None:
        """``marks`` are start, end, start, end, ...; observe their total once it is known."""
        if not marks:
            return
        if not self.on_cuda:
            observe(sum(marks[i + 1] - marks[i] for i in range(0, len(marks), 2)))
            return
        with self._lock:
            self._pending.append((marks, observe))
            oldest = self._pending[0][0][-1] if len(self._pending) > self.MAX_PENDING else None
        if oldest is not None:
            oldest.synchronize()  # only when the device is that far behind the host
        self.poll()

    def poll(self) -> None:
        """Observe every submitted span whose events the device has passed; cheap, never blocks."""
        if not self.on_cuda:
            return
        with self._lock:
            if not self._pending:
                return
            done, waiting = [], []
            for entry in self._pending:
                # Events of one span are on one stream, in order: the last done means all done.
                (done if entry[0][-1].query() else waiting).append(entry)
            self._pending = waiting
        for marks, observe in done:
            ms = sum(marks[i].elapsed_time(marks[i + 1]) for i in range(0, len(marks), 2))
            observe(ms / 1e3)
            self._spare.extend(marks)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)


class Span:
    """One observation made of one or more timed intervals (``with span: ...`` each)."""

    __slots__ = ("_clock", "_observe", "_marks", "_stream")

    def __init__(self, clock: DeviceClock, observe: Observe) -> None:
        self._clock, self._observe, self._marks = clock, observe, []
        self._stream = None

    def __enter__(self) -> "Span":
        if not self._marks:
            self._stream = self._clock.current_stream()
        self._marks.append(self._clock.mark(self._stream))
        return self

    def __exit__(self, *exc) -> None:
        self._marks.append(self._clock.mark(self._stream))

    def submit(self) -> None:
        """Observe the sum of the intervals (nothing if there were none); use the span no more."""
        marks, self._marks = self._marks, []
        self._clock.submit(marks, self._observe)


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One model step as the device ran it (seconds; wall time on a CPU)."""

    step_id: int
    tokens: int
    busy: float             # from the step's first device work to its output's copy to the host
    gap: Optional[float]    # idle since the previous step's end (None: the first step)
    launch: float           # host time the worker took to enqueue the step (wall; all of it on a CPU)


class StepTimeline:
    """The device time of each model step and the idle gap before it, from two CUDA events per
    step on the compute stream (``perf_counter`` on the CPU); ``poll`` reads the steps the device
    has finished, in order, never waiting. A gap is the device idle between two steps: the host
    path that the overlap did not hide (the Ray call, building inputs, a graph capture) or no
    work at all."""

    KEPT = 1 << 16   # recent steps kept for ``recent`` (the serving benchmark reads them)

    def __init__(self, device: torch.device, observe: Callable[[StepTiming], None]) -> None:
        self._on_cuda = device.type == "cuda"
        self._device = device
        self._observe = observe
        self._pending: deque[tuple[int, int, Mark, Mark, float]] = deque()
        self._previous_end: Optional[Mark] = None
        self._lock = threading.Lock()
        self.recent: deque[StepTiming] = deque(maxlen=self.KEPT)

    def begin(self) -> Mark:
        if not self._on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def end(self, step_id: int, tokens: int, start: Mark, launch: float) -> None:
        """After the step's last device work (its output copy) was enqueued; ``launch``: the
        host time its launch took."""
        end = self.begin()
        with self._lock:
            self._pending.append((step_id, tokens, start, end, launch))
        self.poll()

    def poll(self) -> None:
        while True:
            with self._lock:
                if not self._pending or (self._on_cuda and not self._pending[0][3].query()):
                    return
                step_id, tokens, start, end, launch = self._pending.popleft()
                previous, self._previous_end = self._previous_end, end
            if self._on_cuda:
                busy = start.elapsed_time(end) / 1e3
                gap = previous.elapsed_time(start) / 1e3 if previous is not None else None
            else:
                busy, gap = end - start, (start - previous if previous is not None else None)
            timing = StepTiming(step_id, tokens, busy, gap, launch)
            self.recent.append(timing)
            self._observe(timing)


class WorkerMetrics:
    """The registry of one worker and the calls the worker makes as it works.

    ``registry`` is what the worker serves at /metrics. The worker calls ``time_plan_part``
    (through ``KVCache.execute``) and ``observe_plan`` per plan, ``attention_span`` and
    ``observe_model_step`` per model step.
    """

    def __init__(self, cache: KVCache, info: WorkerInfo) -> None:
        self.cache = cache
        self.info = info
        self.clock = DeviceClock(cache.device)
        self.registry = r = CollectorRegistry()
        # Registered first: at each scrape it polls the finished device timings, so the
        # histograms collected after it in the same scrape already hold them.
        r.register(_PollAtScrape(self.poll))
        ProcessCollector(registry=r)
        self._info = Info("kvpager_worker", "Who this worker is; constant 1.", registry=r)
        self.set_info(info)
        blocks = Gauge("kvpager_worker_cache_blocks", "Blocks this worker's cache tensors hold.", ["tier"], registry=r)
        nbytes = Gauge("kvpager_worker_cache_bytes", "Bytes of its cache tensors (the device cache and the pinned "
                       "CPU swap space).", ["tier"], registry=r)
        for tier, tensor in (("gpu", cache.blocks), ("cpu", cache.swap_space)):
            blocks.labels(tier).set(tensor.shape[0])
            nbytes.labels(tier).set(tensor.nbytes)
        on_cuda = cache.device.type == "cuda"
        Gauge("kvpager_worker_device_memory_allocated_bytes", "Device memory held by live tensors (torch's CUDA "
              "allocator; 0 on a CPU worker).", registry=r).set_function(
            lambda: torch.cuda.memory_allocated(cache.device) if on_cuda else 0)
        Gauge("kvpager_worker_device_memory_reserved_bytes", "Device memory the allocator reserved (0 on a CPU "
              "worker).", registry=r).set_function(lambda: torch.cuda.memory_reserved(cache.device) if on_cuda else 0)
        self.plans = Counter("kvpager_worker_plans_total", "Plans executed.", registry=r)
        self.plan_duration = Histogram(
            "kvpager_worker_plan_duration_seconds",
            "Time of each part of a plan that had work of that kind: device time between CUDA events on the "
            "swap stream on a GPU, wall time on a CPU.", ["kind"], buckets=DEVICE_WORK_BUCKETS, registry=r)
        self.moved_blocks = Counter("kvpager_worker_moved_blocks_total", "Blocks moved by plans.", ["direction"],
                                    registry=r)
        self.moved_bytes = Counter("kvpager_worker_moved_bytes_total", "Bytes moved by plans.", ["direction"],
                                   registry=r)
        self.model_steps = Counter("kvpager_worker_model_steps_total", "Model steps run.", registry=r)
        self.computed_tokens = Counter("kvpager_worker_computed_tokens_total",
                                       "Tokens whose K/V the model computed and wrote.", registry=r)
        self.model_step_duration = Histogram(
            "kvpager_worker_model_step_duration_seconds",
            "Time of one model step on this rank, from its first device work to its output's copy to the host "
            "(CUDA events on a GPU, wall time on a CPU).", buckets=MODEL_STEP_BUCKETS, registry=r)
        self.idle = Counter("kvpager_worker_device_idle_seconds_total",
                            "Device time between one model step's end and the next one's start: the host path the "
                            "overlap did not hide, or no work.", registry=r)
        self.timeline = StepTimeline(cache.device, self._observe_timing)
        self.attention_duration = Histogram(
            "kvpager_worker_attention_duration_seconds",
            "Time of one step's attention, summed over layers (CUDA events on a GPU, wall time on a CPU).",
            buckets=DEVICE_WORK_BUCKETS, registry=r)
        for kind, direction in DIRECTIONS.items():  # every series exists from the start, at 0
            self.plan_duration.labels(kind)
            self.moved_blocks.labels(direction)
            self.moved_bytes.labels(direction)

    def set_info(self, info: WorkerInfo) -> None:
        self.info = info
        self._info.info(info.labels())

    def poll(self) -> None:
        """Observe the device timings that have finished (called at each plan and step)."""
        self.clock.poll()
        self.timeline.poll()

    # ---- plans ---------------------------------------------------------------------------------------
    @contextmanager
    def time_plan_part(self, kind: str) -> Iterator[None]:
        """Times one part of a plan (``kind`` in PLAN_KINDS) on the current stream: KVCache.execute
        enters it on its swap stream around each part that has work."""
        span = self.clock.span(self.plan_duration.labels(kind).observe)
        with span:
            yield
        span.submit()

    def observe_plan(self, plan: BlockPlan) -> None:
        """Count one executed plan and the blocks it moved."""
        self.plans.inc()
        block_bytes = self.cache.spec.block_bytes
        for kind, moves in (("swap_out", plan.swap_out), ("swap_in", plan.swap_in), ("copy", plan.copy)):
            blocks = len(moves)
            if blocks:
                self.moved_blocks.labels(DIRECTIONS[kind]).inc(blocks)
                self.moved_bytes.labels(DIRECTIONS[kind]).inc(blocks * block_bytes)

    # ---- model steps ---------------------------------------------------------------------------------
    def attention_span(self) -> Span:
        """A span for one step's attention: the model enters it around each layer's attention."""
        return self.clock.span(self.attention_duration.observe)

    def observe_model_step(self, step_id: int, tokens: int, start: Mark, attention: Span, launch: float) -> None:
        """After the step's work and its output copy were enqueued; ``start`` is
        ``timeline.begin()`` from before its first device work, ``launch`` the host time so far."""
        self.model_steps.inc()
        self.computed_tokens.inc(tokens)
        self.timeline.end(step_id, tokens, start, launch)
        attention.submit()

    def _observe_timing(self, timing: StepTiming) -> None:
        self.model_step_duration.observe(timing.busy)
        if timing.gap is not None:
            self.idle.inc(timing.gap)


class _PollAtScrape:
    """Exports nothing: at each scrape it observes the device timings that have finished."""

    def __init__(self, poll: Callable[[], None]) -> None:
        self._poll = poll

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        self._poll()
        return []
