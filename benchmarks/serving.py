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
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from kvpager.commands.progress import Progress  # noqa: E402 (after the path above)
from kvpager.numeric import ceil_div, percentile  # noqa: E402

BLOCK_SIZE = 16
SYSTEMS = ("kvpager", "transformers")

LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
# build_random_checkpoint arguments of each named model (dtype decided by the device for tiny).
MODELS: dict[str, dict[str, Any]] = {
    "1b": dict(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64, intermediate_size=8192,
               vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
               rope_scaling=dict(LLAMA3_ROPE, factor=32.0), max_position_embeddings=131072, rms_norm_eps=1e-5,
               bos_token_id=128000, eos_token_id=128001),
    "8b": dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
               vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
               rope_scaling=dict(LLAMA3_ROPE, factor=8.0), max_position_embeddings=131072, rms_norm_eps=1e-5,
               bos_token_id=128000, eos_token_id=128001),
    # head_dim 16 on the CPU (fast); 64 on CUDA, a head dim kvpager's decode kernel is built for.
    "tiny": dict(num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512, tie_word_embeddings=True,
                 max_position_embeddings=4096),
}
MODEL_NAMES = {"1b": "Llama-3.2-1B shape", "8b": "Llama-3.1-8B shape", "tiny": "tiny Llama"}
# Workload defaults: (prompt lengths, output lengths, system prompt lengths).
WORKLOADS = {"tiny": ((16, 96), (8, 24), (16, 48))}
DEFAULT_WORKLOAD = ((128, 2048), (128, 512), (256, 1024))


def log(msg: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> Optional[float]:
    """The ``q`` quantile (0 < q < 1) of ``values`` as ``kvpager.numeric.percentile`` interpolates
    it; None for no values."""
    return percentile(values, q * 100) if values else None


def int_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two integers), got {text!r}") from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 0 < MIN <= MAX, got {text!r}")
    return lo, hi


# ---- the workload --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]            # seconds after the start; all 0 when every request arrives at once

    @property
    def ids(self) -> list[str]:
        return [f"req-{i:05d}" for i in range(len(self.prompts))]


def make_workload(count: int, seed: int, vocab_size: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  system_prompts: int, system_len: tuple[int, int], shared_fraction: float,
                  rate: Optional[float]) -> tuple[Workload, dict]:
    rng = random.Random(seed)
    sys_hi = min(system_len[1], prompt_len[1] - 1)
    sys_lo = min(system_len[0], sys_hi)
    systems = [[rng.randrange(vocab_size) for _ in range(rng.randint(sys_lo, sys_hi))]
               for _ in range(system_prompts)] if sys_hi >= 1 else []
    prompts, outputs, shared = [], [], 0
    for _ in range(count):
        if systems and rng.random() < shared_fraction:
            system = rng.choice(systems)
            own = rng.randint(max(1, prompt_len[0] - len(system)), max(1, prompt_len[1] - len(system)))
            prompt = system + [rng.randrange(vocab_size) for _ in range(own)]
            shared += 1
        else:
            prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))]
        prompts.append(prompt)
        outputs.append(rng.randint(*output_len))
    arrivals = [0.0] * count
    if rate:
        arr = random.Random(seed + 1)   # the prompts do not depend on the rate
        t = 0.0
        for i in range(count):
            arrivals[i] = t
            t += arr.expovariate(rate)
    plens = [len(p) for p in prompts]
    info = dict(requests=count, seed=seed, vocab_size=vocab_size, prompt_len=list(prompt_len),
                output_len=list(output_len), system_prompts=len(systems), system_len=[sys_lo, sys_hi],
                shared_fraction=shared_fraction, with_system_prompt=shared,
                rate_per_s=rate, prompt_tokens=sum(plens), prompt_len_mean=statistics.fmean(plens),
                output_tokens=sum(outputs), output_len_mean=statistics.fmean(outputs))
    return Workload(prompts, outputs, arrivals), info


# ---- the model -------------------------------------------------------------------------------------------
def read_hf_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


@dataclasses.dataclass
class ModelFacts:
    """What the roofline and the KV budget need, from config.json (TP 1)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    param_count: int          # parameters held in memory (tied embeddings once)
    decode_read_params: int   # parameters a decode step reads: all but the embedding table when untied
    max_position_embeddings: int

    def kv_bytes_per_token(self, elem: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    @classmethod
    def from_config(cls, c: dict) -> "ModelFacts":
        c = c.get("text_config", c)
        h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        d = c.get("head_dim") or h // heads
        inter, vocab = c["intermediate_size"], c["vocab_size"]
        tied = bool(c.get("tie_word_embeddings", False))
        attn = h * heads * d + 2 * h * kv * d + heads * d * h
        if c.get("attention_bias") or c.get("model_type") == "qwen2":
            attn += (heads + 2 * kv) * d
        if c.get("model_type") == "qwen3":
            attn += 2 * d
        layer = attn + 3 * h * inter + 2 * h
        body = layers * layer + h
        embed = vocab * h
        param_count = body + embed + (0 if tied else embed)
        return cls(layers, kv, d, vocab, param_count, body + embed,
                   int(c.get("max_position_embeddings") or 0))


def checkpoint_args(model: str, cuda: bool) -> tuple[dict, str]:
    shape = dict(MODELS[model])
    if model == "tiny":
        d = 64 if cuda else 16
        shape |= dict(head_dim=d, hidden_size=4 * d, intermediate_size=8 * d)
        return shape, "float32"
    return shape, "bfloat16"


def checkpoint_dir(args: argparse.Namespace, cuda: bool) -> Path:
    shape, dtype = checkpoint_args(args.model, cuda)
    suffix = f"-d{shape['head_dim']}" if args.model == "tiny" else ""
    return Path(args.workdir).expanduser() / f"random-{args.model}{suffix}-{dtype}"


DONE_MARKER = ".serving-bench-complete"


def build_checkpoint(path: Path, model: str, cuda: bool) -> None:
    """Write the random checkpoint into a temporary sibling directory, then rename it into place
    (an interrupted build leaves nothing that looks complete)."""
    from kvpager.checkpoints import build_random_checkpoint

    shape, dtype = checkpoint_args(model, cuda)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".partial-", dir=path.parent))
    started = time.perf_counter()
    kwargs = dict(shape, dtype=dtype, seed=0, tokenizer=False)
    try:
        build_random_checkpoint(tmp, "llama", device="cuda" if cuda else "cpu", **kwargs)
    except TypeError:       # a builder without ``device``
        build_random_checkpoint(tmp, "llama", **kwargs)
    (tmp / DONE_MARKER).write_text(json.dumps(kwargs) + "\n")
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    log(f"built {path} in {time.perf_counter() - started:.0f} s")


def ensure_checkpoint(args: argparse.Namespace, cuda: bool) -> Path:
    if args.checkpoint:
        path = Path(args.checkpoint).expanduser().resolve()
        if not (path / "config.json").exists():
            raise SystemExit(f"--checkpoint {path}: no config.json there")
        return path
    path = checkpoint_dir(args, cuda)
    if (path / DONE_MARKER).exists() and (path / "config.json").exists():
        log(f"reusing the random checkpoint {path}")
        return path
    log(f"building a random {MODEL_NAMES[args.model]} checkpoint in {path} (once; reused by later runs)")
    if cuda:   # generate the weights on the GPU, in a child: this process stays off the GPU
        child = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--workdir", args.workdir,
                 "--_child", "build"]
        if subprocess.run(child, stdout=sys.stderr, timeout=3600).returncode != 0:
            raise SystemExit("building the checkpoint failed (above)")
    else:
        build_checkpoint(path, args.model, cuda)
    return path


def device_memory() -> Optional[tuple[int, int]]:
    """(free, total) bytes of GPU 0, asked in a child process (this one stays off the GPU)."""
    code = "import torch; f, t = torch.cuda.mem_get_info(0); print(f, t)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        free, total = (int(x) for x in out.stdout.split())
        return free, total
    except Exception as exc:  # noqa: BLE001 - reported, and the budget falls back to the workload's need
        log(f"could not read the GPU's free memory: {exc}")
        return None


# ---- timing records -------------------------------------------------------------------------------------
def latency_summary(arrivals: dict[str, float], times: dict[str, list[float]], expected: dict[str, int]) -> dict:
    """Throughput and latency percentiles from each request's arrival and token times."""
    ttft, itl, tpot, e2e = [], [], [], []
    done = complete = tokens = 0
    first = min(arrivals.values()) if arrivals else 0.0
    last = first
    for rid, arrival in arrivals.items():
        ts = times.get(rid) or []
        tokens += len(ts)
        if not ts:
            continue
        done += 1
        complete += len(ts) == expected[rid]
        ttft.append(ts[0] - arrival)
        itl += [b - a for a, b in zip(ts, ts[1:])]
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
        e2e.append(ts[-1] - arrival)
        last = max(last, ts[-1])
    duration = last - first
    ms = 1e3
    return dict(
        requests=len(arrivals), requests_with_tokens=done, requests_complete=complete,
        output_tokens=tokens, expected_output_tokens=sum(expected.values()), duration_s=duration,
        output_tokens_per_s=tokens / duration if duration > 0 else None,
        ttft_p50_ms=_scaled(pct(ttft, 0.5), ms), ttft_p99_ms=_scaled(pct(ttft, 0.99), ms),
        itl_p50_ms=_scaled(pct(itl, 0.5), ms), itl_p99_ms=_scaled(pct(itl, 0.99), ms),
        tpot_p50_ms=_scaled(pct(tpot, 0.5), ms), tpot_p99_ms=_scaled(pct(tpot, 0.99), ms),
        e2e_p50_s=pct(e2e, 0.5), e2e_p99_s=pct(e2e, 0.99))


def _scaled(x: Optional[float], k: float) -> Optional[float]:
    return None if x is None else x * k


def copy_ceiling(torch, device) -> float:
    """Device copy ceiling, bytes/s (read + write bytes / time), as benchmarks/kernels.py measures it."""
    if device.type == "cuda":
        x = torch.empty(1 << 30, dtype=torch.int16, device=device)   # 2 GiB
        x.random_()
        y = torch.empty_like(x)
        for _ in range(2):
            y.copy_(x)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(10)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(10)]
        for s, e in zip(starts, ends):
            s.record()
            y.copy_(x)
            e.record()
        torch.cuda.synchronize()
        t = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3
        nbytes = 2 * x.numel() * x.element_size()
        del x, y
        torch.cuda.empty_cache()
        return nbytes / t
    x = torch.empty(64 << 20, dtype=torch.int32)  # 256 MiB
    x.fill_(1)
    y = torch.empty_like(x)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        samples.append(time.perf_counter() - t0)
    return 2 * x.numel() * x.element_size() / statistics.median(samples)


# ---- kvpager ----------------------------------------------------------------------------------------------
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
                    wall_p50_ms=_scaled(pct([i["wall"] for i in its], 0.5), 1e3),
                    step_rpc_p50_ms=_scaled(pct([i["rpc"] for i in its], 0.5), 1e3),
                    runner_p50_ms=_scaled(pct([i.get("blocked", i["runner"]) for i in its], 0.5), 1e3),
                    python_p50_ms=_scaled(pct([i["wall"] - i["rpc"] - i.get("blocked", i["runner"]) for i in its],
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


# ---- transformers -------------------------------------------------------------------------------------------
def hf_candidates(args: argparse.Namespace, cuda: bool) -> list[tuple[str, Optional[bool]]]:
    """(attention implementation, use_cuda_graph) to try, best first."""
    from importlib.util import find_spec

    if args.hf_attn != "auto":
        impls = [args.hf_attn]
    else:
        impls = []
        if cuda:
            if find_spec("flash_attn_interface") is not None:
                impls.append("flash_attention_3")
            if find_spec("flash_attn") is not None:
                impls.append("flash_attention_2")
        impls += ["sdpa", "eager"]
    out: list[tuple[str, Optional[bool]]] = []
    for impl in impls:
        if not cuda:
            graphs: list[Optional[bool]] = [None]
        elif args.hf_cuda_graphs == "auto":
            # None: transformers decides (on for flash, which needs no attention mask; off for
            # SDPA and eager, whose masks grow with the padding graphs need); flash again without
            # graphs if that fails.
            graphs = [None, False] if "flash" in impl else [None]
        else:
            graphs = [args.hf_cuda_graphs == "on"]
        out += [(impl, g) for g in graphs]
    return out


def _cb_config_class():
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    return ContinuousBatchingConfig


def _cb_fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    import inspect

    return set(inspect.signature(cls).parameters)


def _impl_name(base: str, fields: set[str]) -> str:
    """The name continuous batching runs ``base`` under: 'paged|X' before transformers 5.23 (no
    auto_switch_to_flash field), plain 'X' after (except eager: 'paged|eager' always)."""
    if base.startswith("paged|"):
        return base
    if base == "eager" or "auto_switch_to_flash" not in fields:
        return "paged|" + base
    return base


def run_transformers(spec: dict) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    args = argparse.Namespace(**spec["args"])
    cuda = spec["cuda"]
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, spec["dtype"])
    result: dict[str, Any] = dict(system="transformers", transformers_version=transformers.__version__,
                                  torch_version=torch.__version__, dtype=spec["dtype"])
    started = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=dtype, attn_implementation="sdpa",
                                                     device_map=str(device) if cuda else None)
    except Exception as exc:  # noqa: BLE001 - older loaders: no device_map without accelerate
        log(f"transformers: loading with device_map failed ({exc}); loading then moving")
        model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    # No stop token: the checkpoint's EOS would end random-weight generations early.
    model.config.eos_token_id = None
    if model.generation_config is not None:
        model.generation_config.eos_token_id = None
    log(f"transformers {transformers.__version__}: model loaded in {time.perf_counter() - started:.0f} s")

    wl = spec["workload"]
    ids = [f"req-{i:05d}" for i in range(len(wl["prompts"]))]
    cb_cls = None
    with contextlib.suppress(Exception):
        cb_cls = _cb_config_class()
    attempts = []
    chosen = None
    if cb_cls is not None and hasattr(model, "continuous_batching_context_manager"):
        fields = _cb_fields(cb_cls)
        for impl, graphs in hf_candidates(args, cuda):
            name = _impl_name(impl, fields)
            try:
                cb_kwargs = _cb_kwargs(args, spec, fields, graphs)
                rng = random.Random(54321)
                n = max(1, args.warmup_requests)
                warm = [[rng.randrange(spec["facts"]["vocab_size"]) for _ in range(64 + 16 * i)] for i in range(n)]
                t0 = time.perf_counter()
                res = _hf_serve(model, name, cb_cls, cb_kwargs, [f"warmup-{i}" for i in range(n)], warm, [8] * n,
                                [0.0] * n, args.timeout, quiet=True)
                bad = [r for r in res["outputs"].values() if r["error"] or len(r["tokens"]) != 8]
                if len(res["outputs"]) != n or bad:
                    raise RuntimeError(f"warm-up: {len(res['outputs'])}/{n} results, "
                                       f"{len(bad)} failed or short: {bad[:1]}")
                attempts.append(dict(attn_implementation=name, use_cuda_graph=graphs, ok=True,
                                     warmup_s=time.perf_counter() - t0))
                chosen = (name, cb_kwargs)
                log(f"transformers: {name}, use_cuda_graph={graphs}: warm-up ok in {time.perf_counter() - t0:.1f} s")
                break
            except Exception as exc:  # noqa: BLE001 - try the next one
                msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
                attempts.append(dict(attn_implementation=name, use_cuda_graph=graphs, ok=False, error=msg))
                log(f"transformers: {name}, use_cuda_graph={graphs} failed: {msg}")
                with contextlib.suppress(Exception):
                    model.destroy_cached_continuous_batching_manager()
                import gc

                gc.collect()   # the failed manager's cache
                if cuda:
                    torch.cuda.empty_cache()
    result["attempts"] = attempts
    if chosen is not None:
        name, cb_kwargs = chosen
        res = _hf_serve(model, name, cb_cls, cb_kwargs, ids, wl["prompts"], wl["output_lens"], wl["arrivals"],
                        args.timeout, quiet=False)
        result.update(api="continuous batching (ContinuousBatchingManager, the engine of generate_batch)",
                      attn_implementation=res["attn_implementation"], cb_config=res["cb_config"],
                      kv_cache=res["kv_cache"])
        if res.get("error"):
            result["error"] = res["error"]
    else:
        result["note"] = ("no continuous-batching configuration ran here: plain generate(), one request at a "
                          "time (no batching)")
        log(f"transformers: {result['note']}")
        for impl in ("sdpa", "eager"):   # a paged implementation left behind needs continuous batching's cache
            with contextlib.suppress(Exception):
                model.set_attn_implementation(impl)
                break
        res = _hf_generate_sequential(model, ids, wl["prompts"], wl["output_lens"], wl["arrivals"], args.timeout)
        result.update(api="generate (sequential)", attn_implementation=model.config._attn_implementation)
        if res.get("error"):
            result["error"] = res["error"]
    outs = res["outputs"]
    failed = {rid: o["error"] for rid, o in outs.items() if o["error"]}
    if failed:
        result["failed_requests"] = len(failed)
        result.setdefault("error", f"{len(failed)} requests failed, e.g. {next(iter(failed.values()))}")
    arrivals = {rid: outs[rid]["arrival"] for rid in ids if rid in outs}
    for rid, arrival in zip(ids, wl["arrivals"]):   # requests never answered count with no tokens
        arrivals.setdefault(rid, res["start"] + arrival)
    times = {rid: outs[rid]["times"] for rid in ids if rid in outs}
    result["latency"] = latency_summary(arrivals, times, dict(zip(ids, wl["output_lens"])))
    result["tokens"] = {rid: outs[rid]["tokens"] for rid in ids if rid in outs}
    if cuda:
        result["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return result


def _cb_kwargs(args: argparse.Namespace, spec: dict, fields: set[str], graphs: Optional[bool]) -> dict:
    block = args.hf_block_size or 256
    kw: dict[str, Any] = {}
    kw["page_size" if "page_size" in fields else "block_size"] = block
    kw["num_blocks"] = max(1, spec["kv_tokens"] // block)
    if args.max_batch_tokens:
        kw["max_batch_tokens"] = args.max_batch_tokens
    if graphs is not None:
        kw["use_cuda_graph"] = graphs
    if "auto_switch_to_flash" in fields:
        kw["auto_switch_to_flash"] = False
    if args.hf_compile_level:
        kw["default_compile_level"] = args.hf_compile_level
    if args.hf_max_memory_percent is not None:
        kw["max_memory_percent"] = args.hf_max_memory_percent
    return {k: v for k, v in kw.items() if k in fields}


def _hf_serve(model, impl: str, cb_cls, cb_kwargs: dict, ids: list[str], prompts: list[list[int]],
              output_lens: list[int], offsets: list[float], timeout: float, quiet: bool) -> dict:
    """Serve the requests on a fresh continuous-batching manager, as generate_batch does, with
    each request's own max_new_tokens; retries once without max_batch_tokens when the cache's
    memory check refuses it."""
    try:
        return _hf_serve_once(model, impl, cb_cls, cb_kwargs, ids, prompts, output_lens, offsets, timeout, quiet)
    except MemoryError as exc:
        if "max_batch_tokens" not in cb_kwargs:
            raise
        log(f"transformers: {exc}: retrying with max_batch_tokens left to transformers")
        kw = {k: v for k, v in cb_kwargs.items() if k != "max_batch_tokens"}
        cb_kwargs.pop("max_batch_tokens")
        return _hf_serve_once(model, impl, cb_cls, kw, ids, prompts, output_lens, offsets, timeout, quiet)


def _hf_serve_once(model, impl: str, cb_cls, cb_kwargs: dict, ids: list[str], prompts: list[list[int]],
                   output_lens: list[int], offsets: list[float], timeout: float, quiet: bool) -> dict:
    from transformers import GenerationConfig

    model.set_attn_implementation(impl)
    gen_config = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=None)
    cb_config = cb_cls(**cb_kwargs)
    hints = None
    with contextlib.suppress(Exception):
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                              max_generated_length=max(output_lens), num_requests=len(prompts))
    cm_kwargs = dict(generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=60,
                     warmup=True)
    if hints is not None:
        cm_kwargs["workload_hints"] = hints
    outputs: dict[str, dict] = {}
    progress = Progress(len(ids), "requests done", label="[serving] transformers: ", quiet=quiet)
    error = None
    info: dict[str, Any] = {}
    with model.continuous_batching_context_manager(**cm_kwargs) as manager:
        info["attn_implementation"] = model.config._attn_implementation
        order = sorted(range(len(ids)), key=lambda i: offsets[i])
        if all(o == 0 for o in offsets) and getattr(manager, "_use_prefix_sharing", False):
            order = sorted(order, key=lambda i: prompts[i], reverse=True)   # as generate_batch's add_requests
        start = time.perf_counter()
        deadline = start + timeout
        nxt = 0
        created: dict[str, float] = {}
        try:
            while len(outputs) < len(ids):
                now = time.perf_counter()
                while nxt < len(order) and start + offsets[order[nxt]] <= now:
                    i = order[nxt]
                    manager.add_request(list(prompts[i]), request_id=ids[i], max_new_tokens=output_lens[i],
                                        record_timestamps=True, eos_token_id=-1)
                    created[ids[i]] = start + offsets[i]
                    nxt += 1
                if now > deadline:
                    raise TimeoutError(f"not finished after {timeout:.0f} s (--timeout)")
                wait = 1.0 if nxt >= len(order) else max(0.0, min(1.0, start + offsets[order[nxt]] - now))
                result = manager.get_result(timeout=wait) if wait > 0 else None
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread stopped")
                    continue
                if not result.is_finished():
                    continue
                rid = result.request_id
                arrival = getattr(result, "created_time", None) or created.get(rid, start)
                outputs[rid] = dict(arrival=arrival, times=list(result.timestamps or []),
                                    tokens=list(result.generated_tokens),
                                    error=None if result.error is None else str(result.error))
                progress.update(len(outputs))
        except Exception as exc:  # noqa: BLE001 - reported with what finished
            error = f"{type(exc).__name__}: {exc}"
            if quiet:
                raise
            log(f"transformers: the run stopped: {error}")
            traceback.print_exc()
        finally:
            progress.close()
    cfg = manager.continuous_batching_config
    info["cb_config"] = {k: _jsonable(v) for k, v in vars(cfg).items()} if hasattr(cfg, "__dict__") else str(cfg)
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    block = cb_kwargs.get("page_size", cb_kwargs.get("block_size"))
    info["kv_cache"] = dict(num_blocks=getattr(cfg, "num_blocks", None), block_size=block,
                            tokens=(getattr(cfg, "num_blocks", 0) or 0) * block,
                            max_batch_tokens=getattr(cfg, "max_batch_tokens", None),
                            use_cuda_graph=_jsonable(getattr(cfg, "use_cuda_graph", None)),
                            use_async_batching=getattr(cfg, "use_async_batching", None),
                            prefix_sharing=getattr(manager, "_use_prefix_sharing", None),
                            cache_object=type(cache).__name__ if cache is not None else None)
    return dict(outputs=outputs, start=start, error=error, **info)


def _hf_generate_sequential(model, ids, prompts, output_lens, offsets, timeout: float) -> dict:
    """Plain ``generate``, one request at a time, each token timed by a streamer."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.tokens: list[int] = []
            self.prompt_seen = False

        def put(self, value) -> None:
            if not self.prompt_seen:      # the first call is the prompt
                self.prompt_seen = True
                return
            self.times.append(time.perf_counter())
            self.tokens += [int(x) for x in value.reshape(-1).tolist()]

        def end(self) -> None:
            pass

    outputs: dict[str, dict] = {}
    start = time.perf_counter()
    progress = Progress(len(ids), "requests done", label="[serving] transformers (sequential generate): ")
    error = None
    try:
        for i in sorted(range(len(ids)), key=lambda i: offsets[i]):
            wait = start + offsets[i] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            if time.perf_counter() > start + timeout:
                raise TimeoutError(f"not finished after {timeout:.0f} s (--timeout)")
            s = Stamps()
            x = torch.tensor([prompts[i]], device=model.device)
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=output_lens[i],
                           min_new_tokens=output_lens[i], do_sample=False, eos_token_id=None, pad_token_id=0,
                           streamer=s)
            outputs[ids[i]] = dict(arrival=start + offsets[i], times=s.times, tokens=s.tokens, error=None)
            progress.update(len(outputs))
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
        log(f"transformers: the run stopped: {error}")
    progress.close()
    return dict(outputs=outputs, start=start, error=error)


def _jsonable(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


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


# ---- the report -------------------------------------------------------------------------------------------------
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


def _gib(n: float) -> str:
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
    lines.append(f"  KV budget, each system: {budget['tokens']:,} tokens = {_gib(budget['bytes'])} ({budget['how']})")
    kv, hf = res.get("kvpager", {}), res.get("transformers", {})
    if kv and not kv.get("skipped"):
        mem = kv.get("worker_memory")
        allocated = (f", {_gib(mem[0]['gpu_cache_bytes'])} allocated by the worker ({mem[0]['attention_backend']} "
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
                     f"({_gib((c.get('tokens') or 0) * budget['bytes_per_token'])}), max_batch_tokens "
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
    log(f"KV budget per system: {tokens:,} tokens, {_gib(tokens * per_token)} ({how})")

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
