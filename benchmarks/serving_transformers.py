"""benchmarks/serving.py's transformers side: continuous batching (the engine behind
``generate_batch``) with the fastest paged attention that runs here, or plain ``generate`` per
request when none does; every token timed by transformers' own timestamps."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import time
import traceback
from typing import Any, Optional

from kvpager.commands.progress import Progress
from benchmarks.serving_common import latency_summary, log


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
