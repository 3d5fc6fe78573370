"""How the prefill timings are taken, checked: three shapes of ``kernels.py --only prefill_kernel``,
our kernel (a plan made once; and planned in every call) and cuDNN's SDPA kernel, each timed in
one process three ways: CUDA events around each call after an L2 flush (as ``kernels.timed``, the
table's columns), events around 20 calls back to back (no flush), and the kernels' own durations
(``kernels.kernel_time``: CUPTI, the same flush), with the SM clock (NVML, where pynvml is
installed) before and after and its throttle reasons.

    python3 benchmarks/prefill_timing.py

Why (2026-11-26, eighth session): in ``--only prefill_kernel`` the events read our kernel 14-25%
above its kernel time on 8 x 2K prompts, while here, timed first in a fresh process, they agree.
"""

from __future__ import annotations

import kernels as bench  # benchmarks/kernels.py (this script's folder): shapes, flush and timers
import torch
from torch.nn.attention import SDPBackend

from kvpager.kernels import cuda, debug

SHAPES = ("8 x 2K prompts", "32 x 512 prompts", "1 x 4K prompt")


def sm_clock() -> str:
    """The SM clock in MHz and the throttle reasons bitmask, or n/a without pynvml."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return (f"{pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)} MHz "
                f"(reasons {pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h):#x})")
    except Exception:   # noqa: BLE001 (no pynvml, or no NVML on this machine)
        return "n/a"


def back_to_back(fn, calls: int = 20) -> float:
    """Seconds per call of `calls` calls launched back to back, timed by two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def main() -> None:
    shapes = dict(bench.PREFILL_SHAPES)
    scale = bench.D ** -0.5
    print(f"{'shape':18} {'runner':22} {'events ms':>9} {'clean':>7} {'back to back':>12} {'kernel':>7}  SM clock before / after")
    for name in SHAPES:
        seqs = shapes[name]
        c = bench.prefill_case(seqs, torch.Generator(device="cuda").manual_seed(len(seqs)))
        plan = debug.plan_prefill(c.query, c.k, c.host, warps=8, wgmma=True, schedule="dynamic")
        runners = {
            "ours": lambda: cuda.paged_prefill_run(plan, c.query, c.k, c.v, c.tables, c.lens, c.starts, scale),
            "ours, planned per call": lambda: debug.paged_prefill_attention(
                c.query, c.k, c.v, c.tables, c.lens, c.starts, scale, host_lengths=c.host, warps=8, wgmma=True,
                schedule="dynamic"),
            "cudnn": bench.sdpa_runner(*bench.contiguous_prefill(c, seqs), scale, SDPBackend.CUDNN_ATTENTION, False),
        }
        for label, fn in runners.items():
            bench.warm_up(fn, 0.2)
            before = sm_clock()
            cells = [bench.timed(fn, flush="write"), bench.timed(fn, flush="clean"), back_to_back(fn),
                     bench.kernel_time(fn, flush="write")]
            print(f"{name:18} {label:22} " + " ".join(f"{t * 1e3:{w}.3f}" for t, w in zip(cells, (9, 7, 12, 7))) +
                  f"  {before} / {sm_clock()}", flush=True)
        del c, plan, runners
        torch.cuda.empty_cache()
    print("(medians of 15 calls, the L2 flushed before each, except back to back: the mean of 20)")


if __name__ == "__main__":
    main()
