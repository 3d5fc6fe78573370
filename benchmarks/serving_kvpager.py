"""benchmarks/serving.py's kvpager side: the embedded system driven by the production
``Scheduler`` (its ``on_stage`` hook times the model steps), and where the iterations' time goes
(Step RPC, model step, scheduling in Python; decode steps against the HBM roofline)."""

from __future__ import annotations

import argparse
import contextlib
import random
import time
import traceback
from typing import Any, Optional

from kvpager.commands.progress import Progress
from benchmarks.serving_common import (BLOCK_SIZE, ModelFacts, scaled, copy_ceiling, latency_summary, log,
                                       pct)


class ModelStepTimes:
    """The scheduler's model steps as its ``on_stage`` hook reports them (``kvpager.scheduler``'s
    ``StageCallback``): each step's start, duration and batch, and the time the scheduler waited
    for steps. A submitted step (overlap) runs from its "submit" to the end of its "wait"."""

    def __init__(self) -> None:
        self.calls: list[list] = []  # [start, s, decode, seqs, tokens, ctx, step id]
        self.blocked_s = 0.0         # time the scheduler spent waiting for steps, all calls together
        self._submitted: dict[int, list] = {}   # id of a submitted StepInput -> its call, until its wait

    def __call__(self, stage: str, seconds: float, step) -> None:
        now = time.perf_counter()
        if stage in ("model", "submit"):
            call = [now - seconds, seconds, step.decode_only, step.num_seqs, len(step.token_ids),
                    sum(step.context_lens), step.step_id]
            self.calls.append(call)
            if stage == "model":
                self.blocked_s += seconds
            else:
                self._submitted[id(step)] = call
        elif stage == "wait":
            call = self._submitted.pop(id(step))
            call[1] = now - call[0]
            self.blocked_s += seconds


def _histogram_sums(registry, name: str, labels: Optional[dict] = None) -> tuple[float, float]:
    """(sum, count) of a prometheus_client histogram in ``registry`` (0, 0 when absent)."""
    total = count = 0.0
    try:
        for metric in registry.collect():
            for s in metric.samples:
                if labels and any(s.labels.get(k) != v for k, v in labels.items()):
                    continue
                if s.name == name + "_sum":
                    total += s.value
                elif s.name == name + "_count":
                    count += s.value
    except Exception:  # noqa: BLE001 - internal metrics are a bonus
        pass
    return total, count


def _scrape_worker(address: str) -> dict[str, float]:
    """The model-step and attention histograms' sums and counts of a worker's /metrics."""
    import urllib.request

    out: dict[str, float] = {}
    try:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    except Exception as exc:  # noqa: BLE001
        log(f"could not scrape worker metrics at {address}: {exc}")
        return out
    for line in text.splitlines():
        if line.startswith("kvpager_worker_") and ("_seconds_sum" in line or "_seconds_count" in line):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def run_kvpager(spec: dict) -> dict:
    import torch

    from kvpager.embedded import embedded
    from kvpager.scheduler import Request, SamplingParams, Scheduler
    from kvpager.worker.model import ModelConfig

    args = argparse.Namespace(**spec["args"])
    cuda = spec["cuda"]
    device = torch.device("cuda" if cuda else "cpu")
    result: dict[str, Any] = dict(system="kvpager")
    ceiling = copy_ceiling(torch, device)
    result["copy_ceiling_GBps"] = ceiling / 1e9
    log(f"kvpager: copy ceiling {ceiling / 1e9:,.0f} GB/s ({'2 GiB device copy' if cuda else '256 MiB host copy'})")

    dtype = spec["dtype"]
    model = ModelConfig.from_pretrained(spec["checkpoint"], dtype=dtype, max_model_len=spec["max_model_len"])
    facts = ModelFacts(**spec["facts"])
    elem = torch.empty((), dtype=model.cache_dtype).element_size()
    kv_per_token = facts.kv_bytes_per_token(elem)
    num_gpu_blocks = spec["kv_tokens"] // BLOCK_SIZE
    # Swap space: --cpu-swap-gib, at most twice the GPU pool (pinned host memory takes time to allocate).
    num_cpu_blocks = max(16, min(2 * num_gpu_blocks, int(args.cpu_swap_gib * (1 << 30)) // (kv_per_token * BLOCK_SIZE)))
    weight_bytes = facts.decode_read_params * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    result.update(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, block_size=BLOCK_SIZE,
                  kv_cache_bytes=num_gpu_blocks * BLOCK_SIZE * kv_per_token, kv_bytes_per_token=kv_per_token,
                  decode_weight_bytes=weight_bytes, max_batch_tokens=args.max_batch_tokens, dtype=dtype)

    with contextlib.ExitStack() as stack:
        system = _start_embedded(stack, embedded, model, args, cuda, num_gpu_blocks, num_cpu_blocks)
        result["workers"] = system.kind
        try:
            result["worker_memory"] = _worker_memory(system.runner)
        except Exception as exc:  # noqa: BLE001
            result["worker_memory"] = f"unavailable: {exc}"
        client = system.client

        def new_scheduler(**kw) -> Scheduler:
            return Scheduler(client, system.runner, BLOCK_SIZE, max_batch_tokens=args.max_batch_tokens,
                             max_model_len=getattr(model, "max_model_len", None), overlap=not args.no_overlap, **kw)

        # Warm-up (untimed): kernels' first launches, allocator, Ray's paths.
        if args.warmup_requests:
            rng = random.Random(12345)
            started = time.perf_counter()
            warm = new_scheduler()
            warm_requests = [Request(f"warmup-{i}", [rng.randrange(facts.vocab_size) for _ in range(64 + 16 * i)],
                                     SamplingParams(max_new_tokens=8)) for i in range(args.warmup_requests)]
            _drive(warm, warm_requests, [0.0] * len(warm_requests), args.timeout, None)
            log(f"kvpager: warm-up ({len(warm_requests)} requests) took {time.perf_counter() - started:.1f} s")

        wl = spec["workload"]
        ids = [f"req-{i:05d}" for i in range(len(wl["prompts"]))]
        times: dict[str, list[float]] = {rid: [] for rid in ids}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}

        def on_token(request_id: str, sample: int, token: int, finish_reason: str) -> None:
            now = time.perf_counter()
            times[request_id].append(now)
            tokens[request_id].append(token)

        model_steps = ModelStepTimes()
        progress = Progress(len(ids), "requests done", label="[serving] kvpager: ")
        def on_step(s: Scheduler) -> None:
            progress.update(s.stats.requests_finished, f"running {len(s.running)}, swapped {len(s.swapped)}")

        sched = new_scheduler(on_token=on_token, on_step=on_step, on_stage=model_steps)
        requests = [Request(rid, list(p), SamplingParams(max_new_tokens=o, n=1))
                    for rid, p, o in zip(ids, wl["prompts"], wl["output_lens"])]
        registry = system.service.metrics.registry
        before_stats = client.get_stats()
        disp0 = _histogram_sums(registry, "kvpager_plan_dispatch_duration_seconds")
        rpc0 = _histogram_sums(registry, "kvpager_rpc_duration_seconds", {"method": "Step"})
        worker0 = [_scrape_worker(a) for a in system.worker_metrics]

        iterations, arrivals, error = _drive(sched, requests, wl["arrivals"], args.timeout, model_steps)
        progress.close()
        after_stats = client.get_stats()
        disp1 = _histogram_sums(registry, "kvpager_plan_dispatch_duration_seconds")
        rpc1 = _histogram_sums(registry, "kvpager_rpc_duration_seconds", {"method": "Step"})
        worker1 = [_scrape_worker(a) for a in system.worker_metrics]
        _join_device_timings(iterations, system.runner)
        if error:
            result["error"] = error
        try:
            system.check_invariants()
            result["manager_invariants"] = "OK"
        except Exception as exc:  # noqa: BLE001
            result["manager_invariants"] = f"broken: {exc}"

    with contextlib.suppress(Exception):   # the local Ray cluster the embedded system started
        import ray

        if ray.is_initialized():
            ray.shutdown()
    expected = dict(zip(ids, wl["output_lens"]))
    result["latency"] = latency_summary(arrivals, times, expected)
    st = sched.stats
    result["scheduler"] = dict(steps=st.steps, overlapped_steps=st.overlapped_steps, fed_steps=st.fed_steps, iterations=len(iterations),
                               tokens_computed=st.tokens_computed,
                               tokens_generated=st.tokens_generated, preemptions=st.preemptions,
                               restarts=st.restarts, recoveries=st.recoveries,
                               prefix_hit_tokens=after_stats.prefix_hit_tokens - before_stats.prefix_hit_tokens,
                               prefix_query_tokens=after_stats.prefix_query_tokens - before_stats.prefix_query_tokens)
    result["breakdown"] = _breakdown(iterations, disp1[0] - disp0[0], disp1[1] - disp0[1], rpc1[0] - rpc0[0],
                                     rpc1[1] - rpc0[1])
    if worker0 and worker1:
        w = {k: worker1[0].get(k, 0.0) - worker0[0].get(k, 0.0) for k in worker1[0]}
        result["breakdown"]["worker_metrics_rank0"] = w
    result["decode_roofline"] = _roofline(iterations, args.roofline_min_batch, weight_bytes, kv_per_token, ceiling)
    result["tokens"] = tokens
    return result


def _start_embedded(stack: contextlib.ExitStack, embedded, model, args, cuda: bool, num_gpu_blocks: int,
                    num_cpu_blocks: int):
    """Enter the embedded system; one retry (a local Ray cluster's start sometimes times out)."""
    for attempt in (1, 2):
        cm = embedded(model, block_size=BLOCK_SIZE, tensor_parallel_size=1, use_ray=not args.no_ray,
                      num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                      memory_fraction=args.memory_fraction, metrics_port=0 if args.worker_metrics else None,
                      device=None if cuda else "cpu", cuda_graph_max_batch=args.cuda_graph_max_batch)
        try:
            system = stack.enter_context(cm)
            log(f"kvpager: {system.kind}, {num_gpu_blocks} GPU blocks + {num_cpu_blocks} CPU blocks of "
                f"{BLOCK_SIZE} tokens")
            return system
        except Exception as exc:  # noqa: BLE001
            if attempt == 2:
                raise
            log(f"kvpager: starting the system failed ({type(exc).__name__}: {str(exc)[:300]}); retrying once")
            with contextlib.suppress(Exception):
                import ray

                ray.shutdown()
            time.sleep(2)


def _worker_memory(runner) -> list[dict]:
    stats = runner.memory_stats() if hasattr(runner, "memory_stats") else [runner.__self__.memory_stats()]
    return [dict(device=s.device, num_gpu_blocks=s.num_gpu_blocks, num_cpu_blocks=s.num_cpu_blocks,
                 block_bytes=s.block_bytes, gpu_cache_bytes=s.gpu_cache_bytes, attention_backend=s.attention_backend)
            for s in stats]


def _drive(sched, requests, offsets: list[float], timeout: float, model_steps: Optional[ModelStepTimes]):
    """Serve ``requests`` arriving ``offsets`` seconds after the start; returns (iterations,
    arrival times, error or None). Each iteration: its wall time, its Step RPCs' time, and the
    model step it started (if any), as ``model_steps`` (the scheduler's ``on_stage``) saw it."""
    order = sorted(range(len(requests)), key=lambda i: offsets[i])
    pending = [(offsets[i], requests[i]) for i in order]
    arrivals: dict[str, float] = {}
    iterations: list[dict] = []
    start = time.perf_counter()
    deadline = start + timeout
    idle, nxt = 0, 0
    lat = sched.stats.step_latencies
    error = None
    try:
        while nxt < len(pending) or sched.has_work:
            now = time.perf_counter()
            while nxt < len(pending) and start + pending[nxt][0] <= now:
                offset, request = pending[nxt]
                sched.add(request)
                arrivals[request.request_id] = start + offset
                nxt += 1
            if now > deadline:
                raise TimeoutError(f"not finished after {timeout:.0f} s (--timeout)")
            if not sched.has_work:
                time.sleep(min(0.05, max(0.0, start + pending[nxt][0] - now)))
                continue
            n_lat = len(lat)
            n_calls = len(model_steps.calls) if model_steps else 0
            blocked = model_steps.blocked_s if model_steps else 0.0
            t0 = time.perf_counter()
            progressed = sched.step()
            wall = time.perf_counter() - t0
            if model_steps is not None:   # the step this iteration started (its duration may come later: overlap)
                call = model_steps.calls[n_calls] if len(model_steps.calls) > n_calls else None
                iterations.append(dict(wall=wall, rpc=sum(lat[n_lat:]), rpcs=len(lat) - n_lat,
                                       blocked=model_steps.blocked_s - blocked, call=call))
            idle = 0 if progressed else idle + 1
            if idle > 100:
                raise RuntimeError("no progress in 100 iterations: the KV pool is too small for the requests left")
    except Exception as exc:  # noqa: BLE001 - the numbers so far are still reported
        error = f"{type(exc).__name__}: {exc}"
        log(f"kvpager: the run stopped: {error}")
        traceback.print_exc()
    for it in iterations:
        call = it.pop("call")
        it.update(runner=call[1] if call else 0.0, decode=call[2] if call else False, seqs=call[3] if call else 0,
                  tokens=call[4] if call else 0, context=call[5] if call else 0, step_id=call[6] if call else 0)
    return iterations, arrivals, error


def _join_device_timings(iterations: list[dict], runner) -> None:
    """Add each iteration's model step as rank 0's device ran it (``busy``) and the device idle
    before it (``gap``), by step id (``CacheWorker.step_timings``: needs --worker-metrics)."""
    fetch = getattr(runner, "step_timings", None) or getattr(getattr(runner, "__self__", None), "step_timings", None)
    if fetch is None:
        return
    try:
        by_step = {t.step_id: t for t in fetch()}
    except Exception as exc:  # noqa: BLE001 - the device timings are a bonus
        log(f"kvpager: no device step timings ({type(exc).__name__}: {exc})")
        return
    for it in iterations:
        timing = by_step.get(it["step_id"]) if it["step_id"] else None
        if timing is not None:
            it.update(busy=timing.busy, gap=timing.gap, launch=timing.launch)


def _breakdown(iterations: list[dict], dispatch_s: float, dispatches: float, step_server_s: float,
               step_server_n: float) -> dict:
    def part(its: list[dict]) -> dict:
        # "runner": the time the iteration waited for a model step (the whole call without
        # overlap; with it, only what the Step RPC and the Python did not hide).
        wall = sum(i["wall"] for i in its)
        rpc = sum(i["rpc"] for i in its)
        run = sum(i.get("blocked", i["runner"]) for i in its)
        other = wall - rpc - run
        share = (lambda x: x / wall if wall else None)
        return dict(iterations=len(its), wall_s=wall, step_rpc_s=rpc, runner_s=run, python_s=other,
                    step_rpc_share=share(rpc), runner_share=share(run), python_share=share(other),
                    wall_p50_ms=scaled(pct([i["wall"] for i in its], 0.5), 1e3),
                    step_rpc_p50_ms=scaled(pct([i["rpc"] for i in its], 0.5), 1e3),
                    runner_p50_ms=scaled(pct([i.get("blocked", i["runner"]) for i in its], 0.5), 1e3),
                    python_p50_ms=scaled(pct([i["wall"] - i["rpc"] - i.get("blocked", i["runner"]) for i in its],
                                              0.5), 1e3))

    computed = [i for i in iterations if i["tokens"]]
    out = dict(all=part(computed), decode=part([i for i in computed if i["decode"]]),
               prefill_or_mixed=part([i for i in computed if not i["decode"]]))
    timed = [i for i in computed if i.get("busy")]
    if timed:   # rank 0's device over the whole timed run: busy in steps, idle between them
        busy, idle = sum(i["busy"] for i in timed), sum(i["gap"] or 0.0 for i in timed)
        out["device"] = dict(steps=len(timed), busy_s=busy, idle_s=idle, idle_share=idle / (busy + idle))
    wall = out["all"]["wall_s"]
    out["manager"] = dict(step_server_s=step_server_s, steps=step_server_n, plan_dispatch_s=dispatch_s,
                          plan_dispatches=dispatches,
                          step_server_share=step_server_s / wall if wall else None,
                          plan_dispatch_share=dispatch_s / wall if wall else None)
    return out


def _roofline(iterations: list[dict], min_batch: int, weight_bytes: int, kv_per_token: int, ceiling: float) -> dict:
    steps = [i for i in iterations if i["decode"] and i["seqs"] >= min_batch and i["runner"] > 0]
    out: dict[str, Any] = dict(min_batch=min_batch, steps=len(steps), copy_ceiling_GBps=ceiling / 1e9,
                               weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token)
    if not steps:
        return out
    roof = [(weight_bytes + kv_per_token * i["context"]) / ceiling for i in steps]
    runner = [i["runner"] for i in steps]
    wall = [i["wall"] for i in steps]
    out.update(
        batch_p50=pct([i["seqs"] for i in steps], 0.5), batch_max=max(i["seqs"] for i in steps),
        context_tokens_p50=pct([i["context"] for i in steps], 0.5),
        bytes_p50=pct([weight_bytes + kv_per_token * i["context"] for i in steps], 0.5),
        roofline_p50_ms=pct(roof, 0.5) * 1e3, runner_p50_ms=pct(runner, 0.5) * 1e3,
        iteration_p50_ms=pct(wall, 0.5) * 1e3,
        # time-weighted: all those steps' roofline time over their measured time
        runner_fraction=sum(roof) / sum(runner), iteration_fraction=sum(roof) / sum(wall),
        runner_fraction_p50=pct([r / t for r, t in zip(roof, runner)], 0.5),
        iteration_fraction_p50=pct([r / t for r, t in zip(roof, wall)], 0.5),
        **_device_fractions(steps, roof))
    # The same by batch range: at large batches the GEMMs near their compute limit, which a
    # bytes-only roofline does not count.
    ranges = []
    for lo, hi in ((min_batch, 128), (128, 256), (256, 1 << 30)):
        picked = [k for k, i in enumerate(steps) if max(lo, min_batch) <= i["seqs"] < hi]
        if picked:
            ranges.append(dict(batch_from=max(lo, min_batch), batch_to=hi, steps=len(picked),
                               runner_fraction=sum(roof[k] for k in picked) / sum(runner[k] for k in picked),
                               iteration_fraction=sum(roof[k] for k in picked) / sum(wall[k] for k in picked),
                               **_device_fractions([steps[k] for k in picked], [roof[k] for k in picked])))
    out["by_batch"] = ranges
    return out


def _device_fractions(steps: list[dict], roof: list[float]) -> dict:
    """Of the steps rank 0's device timed (``_join_device_timings``): their roofline time over
    their device time, and the device idle before them over idle plus busy (what the host path
    left exposed). Empty when no step was timed."""
    timed = [(i, r) for i, r in zip(steps, roof) if i.get("busy")]
    if not timed:
        return {}
    busy = sum(i["busy"] for i, _ in timed)
    gaps = [i["gap"] for i, _ in timed if i.get("gap") is not None]
    return dict(device_steps=len(timed), device_fraction=sum(r for _, r in timed) / busy,
                device_busy_p50_ms=pct([i["busy"] for i, _ in timed], 0.5) * 1e3,
                idle_share=sum(gaps) / (sum(gaps) + busy), idle_gap_p50_ms=pct(gaps, 0.5) * 1e3 if gaps else None,
                worker_launch_p50_ms=pct([i["launch"] for i, _ in timed], 0.5) * 1e3)
