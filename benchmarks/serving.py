"""End-to-end serving: kvpager against transformers' continuous batching, same model, same prompts.

One run measures, side by side:

1. **kvpager**: the embedded system (``kvpager.embedded``: the block manager on a loopback gRPC
   port and one Ray GPU worker, block size 16) driven by the reference scheduler
   (``kvpager.scheduler.Scheduler``), every token timed by its ``on_token`` callback;
2. **transformers**: continuous batching (``ContinuousBatchingManager``, the engine behind
   ``model.generate_batch``) on ``AutoModelForCausalLM.from_pretrained(path, dtype=bfloat16)``,
   with the fastest paged attention it can run here (see "transformers" below), every token
   timed by its ``record_timestamps``.

Both greedy, no stop token (EOS disabled on both sides), so every request generates exactly its
output length in both systems; both get the same KV-cache budget in tokens (the table states
both in blocks). Requests arrive all at once (default) or as a Poisson process (``--rate``).

**Workload** (seeded, the same token ids for both): ``--requests`` (512) prompts of 128-2,048
tokens, 70% of them starting with one of 8 shared system prompts (256-1,024 tokens), random
token ids; outputs of 128-512 tokens.

**Models**: ``--model 1b`` (Llama-3.2-1B's shape: hidden 2048, 16 layers, 32/8 heads of 64,
MLP 8192, vocabulary 128,256, tied embeddings, llama3 RoPE) or ``8b`` (Llama-3.1-8B's: hidden
4096, 32 layers, 32/8 heads of 128, MLP 14336, untied), random bf16 weights written once by
``kvpager.checkpoints.build_random_checkpoint`` into ``--workdir`` and reused; ``--checkpoint
DIR`` for any local Llama-family checkpoint; ``--model tiny`` for a smoke run on a CPU.

**Reported** for both systems and the ratio kvpager / transformers: output tokens/s (output
tokens over the time from the first arrival to the last token), time to first token p50/p99
(arrival to first token), inter-token latency p50/p99 (every gap between consecutive tokens of
a request, pooled over requests), plus end-to-end latency and time per output token in the
JSON. For kvpager also:

- where each scheduler iteration goes: the Step RPC round trip as the scheduler measures it
  (``stats.step_latencies``; it includes the manager's own work and its dispatch of the step's
  swap/copy plan to the worker, both also read from the manager's in-process metrics), the model
  step (the runner call: Ray call, forward, logits back to the driver, timed by the scheduler's
  own ``on_stage`` hook: the benchmark drives the production ``Scheduler`` unchanged), and the
  rest, scheduling in Python (building operations and the StepInput, sampling, callbacks);
- decode steps at batch >= ``--roofline-min-batch`` (64) against the HBM roofline: bytes a
  decode step must read (the weights, lm_head included, + K and V of every context token of the
  batch) over a copy ceiling measured in the same run (a device-to-device copy of 2 GiB timed with
  CUDA events; read + write bytes / time, as benchmarks/kernels.py measures it): the fraction
  of that time the model step (runner call) and the whole iteration reach.

**transformers**: ``generate_batch`` takes one ``max_new_tokens`` for all its inputs, so the
script drives the manager it wraps (``continuous_batching_context_manager`` + ``add_request``
with each request's own ``max_new_tokens``), as ``generate_batch`` does (inputs sorted the same
way when prefix sharing is on). Attention implementations tried, best first, each checked by a
small warm-up run (a failure moves on to the next): FlashAttention 3, then 2 (when their package
is installed; ``paged|flash_attention_N`` in transformers < 5.23, ``flash_attention_N`` later),
SDPA over the paged cache (``paged|sdpa``; ``sdpa`` in >= 5.23, with ``auto_switch_to_flash``
off), eager (``paged|eager``). CUDA graphs: ``ContinuousBatchingConfig(use_cuda_graph=True)``
(transformers turns them on by itself only for flash, which needs no attention mask; with SDPA
every step attends over the padded K/V of the whole batch through a mask, which graphs' padding
enlarges): by default transformers' own choice, flash retried without graphs if it fails;
``--hf-cuda-graphs on|off`` forces them. The table names what ran.
If no continuous-batching configuration runs at all, plain ``generate`` per request (no
batching), with a note.

Each system runs in its own child process (``--in-process``: in this one), so a crash, a CUDA
error or an out-of-memory of one side leaves the other's numbers; a side that fails is reported
with its error. Every loop is bounded (``--timeout`` per side); progress goes to stderr.

The parts: ``serving_common.py`` (model shapes, workload, checkpoint, latency figures),
``serving_kvpager.py`` and ``serving_transformers.py`` (one system each), ``serving_report.py``
(the table); this script sizes the KV budget, runs each side in its own process and reports.

Run:  python benchmarks/serving.py --model 1b                       (not yet timed on the H100)
      python benchmarks/serving.py --model 8b --json serving-8b.json
      python benchmarks/serving.py --model 1b --requests 128 --rate 8   (Poisson arrivals, 8/s)
      python benchmarks/serving.py --model tiny --requests 8            (CPU smoke run, ~1 min; ~15 s
                                                         with --no-ray --in-process)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional


ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

# The parts, one module each (benchmarks/serving_*.py); imported after the path above.
from benchmarks.serving_common import (BLOCK_SIZE, DEFAULT_WORKLOAD, MODEL_NAMES, MODELS, SYSTEMS,  # noqa: E402
                                       WORKLOADS, ModelFacts, build_checkpoint, checkpoint_dir, device_memory,
                                       ensure_checkpoint, int_range, log, make_workload, read_hf_config)
from benchmarks.serving_kvpager import run_kvpager  # noqa: E402
from benchmarks.serving_report import ROWS, gib, agreement, report  # noqa: E402
from benchmarks.serving_transformers import run_transformers  # noqa: E402
from kvpager.numeric import ceil_div  # noqa: E402
# What tests/unit/test_serving_bench.py reads through this script.
from benchmarks.serving_common import latency_summary  # noqa: E402,F401
from benchmarks.serving_transformers import _impl_name  # noqa: E402,F401


# ---- the two sides, isolated -----------------------------------------------------------------------------------
RUNNERS = {"kvpager": run_kvpager, "transformers": run_transformers}


def run_side(side: str, spec: dict, in_process: bool, timeout: float) -> dict:
    """One system's result; {'error': ...} when it failed (a crash, a timeout, an exception)."""
    log(f"--- {side} ---")
    started = time.perf_counter()
    if in_process:
        try:
            return RUNNERS[side](spec)
        except Exception as exc:  # noqa: BLE001 - the other side's numbers still count
            traceback.print_exc()
            return dict(system=side, error=f"{type(exc).__name__}: {exc}")
        finally:
            log(f"{side}: {time.perf_counter() - started:.0f} s")
    with tempfile.TemporaryDirectory(prefix="kvpager-serving-") as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", side, "--_spec", str(spec_file),
               "--_out", str(out_file)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, stdout=sys.stderr, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            return dict(system=side, error=f"killed after {timeout:.0f} s")
        except BaseException:   # Ctrl-C: the child has its own session, so stop it (and its Ray) here
            _stop_group(proc)
            raise
        finally:
            log(f"{side}: {time.perf_counter() - started:.0f} s")
        if out_file.exists():
            result = json.loads(out_file.read_text())
            if rc != 0:
                result.setdefault("error", f"child exited with status {rc}")
            return result
        return dict(system=side, error=f"child exited with status {rc} and no result (its stderr is above)")


def _stop_group(proc: subprocess.Popen) -> None:
    """Interrupt the child's process group (the child and what it started, Ray included), then
    kill what is left after 20 s."""
    import signal

    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def child_main(args: argparse.Namespace) -> int:
    if args._child == "build":
        build_checkpoint(checkpoint_dir(args, True), args.model, True)
        return 0
    spec = json.loads(Path(args._spec).read_text())
    try:
        result = RUNNERS[args._child](spec)
        rc = 0
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        traceback.print_exc()
        result = dict(system=args._child, error=f"{type(exc).__name__}: {exc}")
        rc = 1
    Path(args._out).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)   # skip interpreter teardown (Ray's and CUDA's atexit hooks can hang after a failure)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring for details.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="1b",
                    help="random-weight model shape (1b: Llama-3.2-1B, 8b: Llama-3.1-8B, tiny: CPU smoke run)")
    ap.add_argument("--checkpoint", metavar="DIR", help="a local Llama-family checkpoint instead of --model's")
    ap.add_argument("--workdir", default=os.environ.get("KVPAGER_BENCH_WORKDIR", "~/.cache/kvpager/serving-bench"),
                    help="where random checkpoints are built and reused")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--rate", type=float, default=None, metavar="R",
                    help="Poisson arrivals at R requests/s (default: all at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int_range, metavar="MIN,MAX",
                    help="prompt lengths (default 128,2048; tiny 16,96)")
    ap.add_argument("--output-len", type=int_range, metavar="MIN,MAX",
                    help="output lengths (default 128,512; tiny 8,24)")
    ap.add_argument("--system-prompts", type=int, default=8, help="shared system prompts")
    ap.add_argument("--system-len", type=int_range, metavar="MIN,MAX",
                    help="system prompt lengths (default 256,1024; tiny 16,48)")
    ap.add_argument("--shared-fraction", type=float, default=0.7, help="requests that start with a system prompt")
    ap.add_argument("--systems", default="kvpager,transformers", help="which to run, comma-separated")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="KV-cache budget of each system in GiB (default: what the workload needs, at most "
                         "--kv-fraction of the GPU memory left after the weights)")
    ap.add_argument("--kv-fraction", type=float, default=0.65,
                    help="cap of the default KV budget: this fraction of (free GPU memory - weights)")
    ap.add_argument("--max-batch-tokens", type=int, default=8192,
                    help="most tokens per step, both systems (0: each its own default)")
    ap.add_argument("--cpu-swap-gib", type=float, default=4.0, help="kvpager's CPU swap space")
    ap.add_argument("--memory-fraction", type=float, default=0.9,
                    help="kvpager worker's memory_fraction (unused: the KV budget sets its block count)")
    ap.add_argument("--cuda-graph-max-batch", type=int, default=512,
                    help="kvpager: decode steps of up to N sequences replay CUDA graphs (0: all eager)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="kvpager: send each Step RPC after the previous step finished (default: while it computes)")
    ap.add_argument("--no-ray", action="store_true", help="kvpager: one in-process worker instead of a Ray actor")
    ap.add_argument("--worker-metrics", action="store_true",
                    help="kvpager: serve the worker's /metrics and report its own model-step time")
    ap.add_argument("--roofline-min-batch", type=int, default=64)
    ap.add_argument("--warmup-requests", type=int, default=8, help="untimed warm-up requests per system (0: none)")
    ap.add_argument("--hf-attn", default="auto",
                    help="transformers attention: auto (best available first) or one of flash_attention_3, "
                         "flash_attention_2, sdpa, eager (or a full name such as paged|sdpa)")
    ap.add_argument("--hf-cuda-graphs", choices=("auto", "on", "off"), default="auto",
                    help="transformers CUDA graphs (ContinuousBatchingConfig.use_cuda_graph): auto lets transformers "
                         "decide (on for flash attention, off for sdpa/eager), flash retried without on failure")
    ap.add_argument("--hf-block-size", type=int, default=None,
                    help="transformers' KV block (page) size in tokens (default: its own, 256)")
    ap.add_argument("--hf-compile-level", type=int, default=0, help="ContinuousBatchingConfig.default_compile_level")
    ap.add_argument("--hf-max-memory-percent", type=float, default=None,
                    help="ContinuousBatchingConfig.max_memory_percent (default: transformers')")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds each system may take")
    ap.add_argument("--in-process", action="store_true", help="run both systems in this process (no isolation)")
    ap.add_argument("--json", metavar="FILE", help="write the numbers here")
    ap.add_argument("--save-side", metavar="DIR",
                    help="also write each system's raw result (tokens included) to DIR/<system>.json, for --load-side")
    ap.add_argument("--load-side", metavar="SYSTEM=FILE", action="append", default=[],
                    help="take SYSTEM's result from a --save-side file of an earlier run of the same workload, model "
                         "and KV budget (checked) instead of running it: the two systems of a comparison in two "
                         "commands, when one command may not run both")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_spec", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.max_batch_tokens = args.max_batch_tokens or None
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args._child:
        return child_main(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        raise SystemExit(f"--systems: choose among {', '.join(SYSTEMS)}")
    loaded = parse_load_side(args.load_side)
    import torch   # no CUDA context here: is_available() only counts devices

    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        raise SystemExit("--device cuda: no GPU here")
    device_name = "CPU"
    if cuda:
        with contextlib.suppress(Exception):
            device_name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                                         capture_output=True, text=True, timeout=30).stdout.strip() or "CUDA GPU"
    dtype = "bfloat16" if cuda else "float32"

    path = ensure_checkpoint(args, cuda)
    hf_cfg = read_hf_config(path)
    facts = ModelFacts.from_config(hf_cfg)
    defaults = WORKLOADS.get(args.model if not args.checkpoint else "", DEFAULT_WORKLOAD)
    workload, wl_info = make_workload(
        args.requests, args.seed, facts.vocab_size, args.prompt_len or defaults[0], args.output_len or defaults[1],
        args.system_prompts, args.system_len or defaults[2], args.shared_fraction, args.rate)
    max_len = max(len(p) + o for p, o in zip(workload.prompts, workload.output_lens))
    max_model_len = min(facts.max_position_embeddings or 1 << 30, max(256, 1 << (max_len - 1).bit_length()))

    # The KV budget, the same number of tokens for both systems.
    elem = 2 if dtype != "float32" else 4
    per_token = facts.kv_bytes_per_token(elem)
    hf_block = args.hf_block_size or 256
    need = sum(ceil_div(len(p) + o, hf_block) * hf_block for p, o in zip(workload.prompts, workload.output_lens))
    if args.kv_gib is not None:
        tokens, how = int(args.kv_gib * (1 << 30)) // per_token, "--kv-gib"
    elif cuda and (mem := device_memory()) is not None:
        free, total = mem
        cap = int(args.kv_fraction * (free - facts.param_count * elem)) // per_token
        tokens = min(need, cap)
        which = ("what the workload needs" if need <= cap
                 else f"capped at {args.kv_fraction:g} x (free memory - weights)")
        how = (f"{which}; the workload needs {need:,} tokens in blocks of {hf_block}; GPU free {free / 2**30:.1f} of "
               f"{total / 2**30:.1f} GiB at the start")
    else:
        tokens, how = need, f"what the workload needs, {need:,} tokens in blocks of {hf_block}"
    lcm = BLOCK_SIZE * hf_block // math.gcd(BLOCK_SIZE, hf_block)
    tokens = max(lcm, tokens // lcm * lcm)
    budget = dict(tokens=tokens, bytes=tokens * per_token, bytes_per_token=per_token, how=how,
                  kvpager_blocks=tokens // BLOCK_SIZE, transformers_blocks=tokens // hf_block)
    log(f"KV budget per system: {tokens:,} tokens, {gib(tokens * per_token)} ({how})")

    spec = dict(args={k: v for k, v in vars(args).items() if not k.startswith("_")}, cuda=cuda, dtype=dtype,
                checkpoint=str(path), facts=dataclasses.asdict(facts), kv_tokens=tokens, max_model_len=max_model_len,
                workload=dict(prompts=workload.prompts, output_lens=workload.output_lens, arrivals=workload.arrivals))
    results: dict[str, dict] = {}
    key = run_key(spec)
    for side in SYSTEMS:
        if side in loaded:
            results[side] = load_side(side, loaded[side], key)
            continue
        if side not in systems:
            results[side] = dict(system=side, skipped=True)
            continue
        results[side] = run_side(side, spec, args.in_process, args.timeout + 600)
        if results[side].get("error"):
            log(f"{side}: {results[side]['error']}")
        if args.save_side:
            out = Path(args.save_side) / f"{side}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(dict(key=key, result=results[side])) + "\n")
            log(f"wrote {side}'s raw result to {out}")

    tokens_kv = results["kvpager"].pop("tokens", None) or {}
    tokens_hf = results["transformers"].pop("tokens", None) or {}
    ratio = {}
    la, lb = results["kvpager"].get("latency") or {}, results["transformers"].get("latency") or {}
    for _, key, _ in ROWS:
        a, b = la.get(key), lb.get(key)
        ratio[key] = a / b if a is not None and b else None
    summary = dict(
        config=dict(model=args.model if not args.checkpoint else None, checkpoint=str(path),
                    model_desc=(f"checkpoint {path.name}" if args.checkpoint else
                                f"{MODEL_NAMES[args.model]}, random weights"),
                    dtype=dtype, device=device_name, params=facts.param_count, args=spec["args"],
                    max_model_len=max_model_len),
        workload=wl_info, kv_budget=budget, systems=results, ratio_kvpager_over_transformers=ratio,
        agreement=agreement(tokens_kv, tokens_hf))
    print(report(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        log(f"wrote {args.json}")
    ok = all(not results[s].get("error") for s in set(systems) | set(loaded))
    return 0 if ok else 1


def parse_load_side(items: list[str]) -> dict[str, Path]:
    """``--load-side SYSTEM=FILE`` values as {system: path}; SystemExit for a malformed one."""
    loaded = {}
    for item in items:
        side, sep, file = item.partition("=")
        if not sep or side not in SYSTEMS or not file:
            raise SystemExit(f"--load-side {item!r}: expected SYSTEM=FILE with SYSTEM one of {', '.join(SYSTEMS)}")
        loaded[side] = Path(file)
    return loaded


def run_key(spec: dict) -> dict:
    """What two runs must share for their systems' results to be compared: the model files'
    config, dtype, device kind, KV budget and a digest of the workload (prompts, output lengths,
    arrival times)."""
    import hashlib

    digest = hashlib.sha256(json.dumps(spec["workload"], sort_keys=True).encode()).hexdigest()
    return dict(facts=spec["facts"], dtype=spec["dtype"], cuda=spec["cuda"], kv_tokens=spec["kv_tokens"],
                max_model_len=spec["max_model_len"], workload_sha256=digest)


def load_side(side: str, path: Path, key: dict) -> dict:
    """A ``--save-side`` result for ``side``, after checking it ran this comparison (``run_key``)."""
    saved = json.loads(path.read_text())
    if saved.get("key") != key:
        diff = sorted(k for k in key if saved.get("key", {}).get(k) != key[k])
        raise SystemExit(f"--load-side {side}={path}: that run differs from this one in {', '.join(diff)}; "
                         "use the same --model/--checkpoint, --requests, --seed, workload flags and KV budget")
    log(f"{side}: result taken from {path} (an earlier run of the same comparison)")
    return dict(saved["result"], loaded_from=str(path))


if __name__ == "__main__":
    sys.exit(main())
