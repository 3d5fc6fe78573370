"""benchmarks/serving.py's shared parts: the model shapes, the seeded workload, the checkpoint
built once, latency figures from token times, the device's copy ceiling, the log line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from kvpager.numeric import percentile


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
        # (serving.py's child_main builds it: this module has no command line of its own.)
        child = [sys.executable, str(Path(__file__).resolve().with_name("serving.py")), "--model", args.model,
                 "--workdir", args.workdir, "--_child", "build"]
        if subprocess.run(child, stdout=sys.stderr, timeout=3600).returncode != 0:
            raise SystemExit("building the checkpoint failed (above)")
        if not (path / DONE_MARKER).exists():
            raise SystemExit(f"building the checkpoint left nothing complete at {path}")
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
        ttft_p50_ms=scaled(pct(ttft, 0.5), ms), ttft_p99_ms=scaled(pct(ttft, 0.99), ms),
        itl_p50_ms=scaled(pct(itl, 0.5), ms), itl_p99_ms=scaled(pct(itl, 0.99), ms),
        tpot_p50_ms=scaled(pct(tpot, 0.5), ms), tpot_p99_ms=scaled(pct(tpot, 0.99), ms),
        e2e_p50_s=pct(e2e, 0.5), e2e_p99_s=pct(e2e, 0.99))


def scaled(x: Optional[float], k: float) -> Optional[float]:
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
