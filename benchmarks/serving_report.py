"""benchmarks/serving.py's report: the table of both systems, where kvpager's iterations go, its
decode steps against the roofline, and how far the two systems' greedy tokens agree."""

from __future__ import annotations

import statistics

from benchmarks.serving_common import BLOCK_SIZE, SYSTEMS


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict:
    common = [rid for rid in a if rid in b and a[rid] and b[rid]]
    if not common:
        return dict(requests=0)
    first = sum(a[r][0] == b[r][0] for r in common)
    full = sum(a[r] == b[r] for r in common)
    prefix = []
    for r in common:
        n = 0
        for x, y in zip(a[r], b[r]):
            if x != y:
                break
            n += 1
        prefix.append(n / max(len(a[r]), len(b[r])))
    return dict(requests=len(common), first_token=first / len(common), identical=full / len(common),
                common_prefix_mean=statistics.fmean(prefix))


ROWS = [("output tokens/s", "output_tokens_per_s", "{:,.0f}"), ("TTFT p50 (ms)", "ttft_p50_ms", "{:,.1f}"),
        ("TTFT p99 (ms)", "ttft_p99_ms", "{:,.1f}"), ("ITL p50 (ms)", "itl_p50_ms", "{:,.2f}"),
        ("ITL p99 (ms)", "itl_p99_ms", "{:,.2f}"), ("TPOT p50 (ms)", "tpot_p50_ms", "{:,.2f}"),
        ("E2E latency p50 (s)", "e2e_p50_s", "{:,.2f}"), ("duration (s)", "duration_s", "{:,.1f}"),
        ("output tokens", "output_tokens", "{:,}"), ("requests complete", "requests_complete", "{:,}")]


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 1 << 30 else f"{n / 2**20:.1f} MiB"


def _fmt(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(v)


def report(summary: dict) -> str:
    lines = []
    cfg, wl, budget = summary["config"], summary["workload"], summary["kv_budget"]
    res = summary["systems"]
    lines.append(f"serving benchmark: {cfg['model_desc']} ({cfg['checkpoint']}), {cfg['dtype']}, on {cfg['device']}")
    rate = "all at once" if not wl["rate_per_s"] else f"Poisson arrivals at {wl['rate_per_s']:g}/s"
    lines.append(f"  {wl['requests']} requests, {rate}; prompts {wl['prompt_len'][0]}-{wl['prompt_len'][1]} tokens "
                 f"(mean {wl['prompt_len_mean']:.0f}; {wl['with_system_prompt']} start with one of "
                 f"{wl['system_prompts']} system prompts of {wl['system_len'][0]}-{wl['system_len'][1]}), outputs "
                 f"{wl['output_len'][0]}-{wl['output_len'][1]} (mean {wl['output_len_mean']:.0f}, "
                 f"{wl['output_tokens']:,} in all); greedy, no stop token")
    lines.append(f"  KV budget, each system: {budget['tokens']:,} tokens = {gib(budget['bytes'])} ({budget['how']})")
    kv, hf = res.get("kvpager", {}), res.get("transformers", {})
    if kv and not kv.get("skipped"):
        mem = kv.get("worker_memory")
        allocated = (f", {gib(mem[0]['gpu_cache_bytes'])} allocated by the worker ({mem[0]['attention_backend']} "
                     f"attention)" if isinstance(mem, list) and mem else "")
        lines.append(f"  kvpager: {kv.get('workers', '?')}; {kv.get('num_gpu_blocks', '?')} blocks of {BLOCK_SIZE}"
                     f"{allocated} (+ {kv.get('num_cpu_blocks', '?')} CPU swap blocks); scheduler max_batch_tokens "
                     f"{kv.get('max_batch_tokens')}")
    if hf and not hf.get("skipped"):
        line = (f"  transformers {hf.get('transformers_version', '?')}: {hf.get('api', '?')}; attention "
                f"{hf.get('attn_implementation', '?')}")
        if c := hf.get("kv_cache"):
            line += (f", CUDA graphs (varlen, decode) {c.get('use_cuda_graph')}, async batching "
                     f"{c.get('use_async_batching')}; {c.get('num_blocks')} blocks of {c.get('block_size')} "
                     f"({gib((c.get('tokens') or 0) * budget['bytes_per_token'])}), max_batch_tokens "
                     f"{c.get('max_batch_tokens')}, prefix sharing {c.get('prefix_sharing')}")
        lines.append(line)
        failed = [a for a in hf.get("attempts") or [] if not a.get("ok")]
        for a in failed:
            lines.append(f"    (tried first: {a['attn_implementation']}, use_cuda_graph={a['use_cuda_graph']}: "
                         f"{a.get('error', '')[:200]})")
        if hf.get("note"):
            lines.append(f"  note: {hf['note']}")
    lines.append("")
    lines.append(f"| {'metric':<22} | {'kvpager':>12} | {'transformers':>12} | {'kvpager / transformers':>22} |")
    lines.append(f"|{'-' * 24}|{'-' * 13}:|{'-' * 13}:|{'-' * 23}:|")
    la, lb = kv.get("latency") or {}, hf.get("latency") or {}
    for label, key, fmt in ROWS:
        a, b = la.get(key), lb.get(key)
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        lines.append(f"| {label:<22} | {_fmt(fmt, a):>12} | {_fmt(fmt, b):>12} | {ratio:>22} |")
    for side in SYSTEMS:
        r = res.get(side, {})
        if r.get("error"):
            lines.append(f"  {side} FAILED: {r['error']}")
        elif r.get("skipped"):
            lines.append(f"  {side}: not run (--systems)")
    if (bd := kv.get("breakdown")) and bd["all"]["iterations"]:
        lines.append("")
        lines.append("kvpager, where the scheduler's iterations go (share of wall time; p50 per iteration in ms):")
        for name in ("all", "decode", "prefill_or_mixed"):
            p = bd[name]
            if not p["iterations"]:
                continue
            lines.append(f"  {name:<17} {p['iterations']:>6} iterations, {p['wall_s']:.1f} s: Step RPC "
                         f"{p['step_rpc_share']:.1%} ({p['step_rpc_p50_ms']:.2f}), waiting on the model step "
                         f"{p['runner_share']:.1%} ({p['runner_p50_ms']:.2f}), scheduler Python "
                         f"{p['python_share']:.1%} ({p['python_p50_ms']:.2f}); iteration p50 {p['wall_p50_ms']:.2f}")
        m = bd["manager"]
        if m.get("step_server_share") is not None:
            lines.append(f"  inside the Step RPCs: the manager's Step handler {m['step_server_share']:.1%} of the wall "
                         f"time, of which plan dispatch to the worker {m['plan_dispatch_share']:.1%} "
                         f"({m['plan_dispatches']:.0f} plans)")
        if (dv := bd.get("device")) is not None:
            lines.append(f"  rank 0's device (CUDA events): busy {dv['busy_s']:.1f} s in {dv['steps']} steps, idle "
                         f"between them {dv['idle_s']:.1f} s = {dv['idle_share']:.1%} (the control plane the overlap "
                         "did not hide)")
        if bd.get("worker_metrics_rank0"):
            w = bd["worker_metrics_rank0"]
            s, n = w.get("kvpager_worker_model_step_duration_seconds_sum"), \
                w.get("kvpager_worker_model_step_duration_seconds_count")
            if s is not None and n:
                wall = bd["all"]["wall_s"]
                sc = kv.get("scheduler", {})
                lines.append(f"  worker-side model step (its /metrics): {s:.1f} s over {n:.0f} steps; exposed control "
                             f"plane (wall time outside them): {1 - s / wall:.1%}; {sc.get('overlapped_steps', 0)} of "
                             f"{sc.get('steps', 0)} Step RPCs overlapped a computing step, "
                             f"{sc.get('fed_steps', 0)} steps sent before the previous one's tokens came back")
    if (rf := kv.get("decode_roofline")) is not None:
        lines.append("")
        if rf.get("steps"):
            lines.append(
                f"kvpager decode steps at batch >= {rf['min_batch']}: {rf['steps']} steps, batch p50 "
                f"{rf['batch_p50']} (max {rf['batch_max']}), context tokens p50 {rf['context_tokens_p50']:,}; "
                f"bytes to read p50 {rf['bytes_p50'] / 1e9:.2f} GB (weights {rf['weight_bytes'] / 1e9:.2f} GB + "
                f"K/V {rf['kv_bytes_per_token']:,} B/token); copy ceiling {rf['copy_ceiling_GBps']:,.0f} GB/s")
            lines.append(
                f"  roofline p50 {rf['roofline_p50_ms']:.2f} ms; model step (runner call) p50 "
                f"{rf['runner_p50_ms']:.2f} ms = {rf['runner_fraction']:.1%} of roofline (per-step p50 "
                f"{rf['runner_fraction_p50']:.1%}); whole iteration p50 {rf['iteration_p50_ms']:.2f} ms = "
                f"{rf['iteration_fraction']:.1%} (p50 {rf['iteration_fraction_p50']:.1%})")
            for r in rf.get("by_batch", []):
                upper = f"< {r['batch_to']}" if r["batch_to"] < 1 << 30 else "and up"
                lines.append(f"    batch {r['batch_from']} {upper}: {r['steps']} steps, runner call "
                             f"{r['runner_fraction']:.1%} of roofline, whole iteration {r['iteration_fraction']:.1%}"
                             + (f"; on the device {r['device_fraction']:.1%} of roofline, device idle before "
                                f"them {r['idle_share']:.1%}" if "device_fraction" in r else ""))
            if "device_fraction" in rf:
                lines.append(f"  on rank 0's device (CUDA events, {rf['device_steps']} steps): step p50 "
                             f"{rf['device_busy_p50_ms']:.2f} ms = {rf['device_fraction']:.1%} of roofline; device "
                             f"idle between steps {rf['idle_share']:.1%} of the time (gap p50 "
                             f"{rf['idle_gap_p50_ms'] or 0:.2f} ms); the worker's launch of a step (host) p50 "
                             f"{rf['worker_launch_p50_ms']:.2f} ms")
        else:
            lines.append(f"kvpager decode steps at batch >= {rf['min_batch']}: none in this run "
                         f"(copy ceiling {rf['copy_ceiling_GBps']:,.0f} GB/s)")
    if (ag := summary.get("agreement")) and ag.get("requests"):
        lines.append("")
        lines.append(f"greedy tokens, kvpager vs transformers over {ag['requests']} requests: first token equal in "
                     f"{ag['first_token']:.1%}, whole output in {ag['identical']:.1%}, common prefix "
                     f"{ag['common_prefix_mean']:.1%} of the output on average (random weights and bf16: near-ties "
                     f"diverge; informative, not a check)")
    return "\n".join(lines)
