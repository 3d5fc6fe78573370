"""Generate text with a local Hugging Face checkpoint (`kvpager generate --model DIR PROMPT ...`).

Runs the whole system in this process (``kvpager.embedded``: the block manager, the workers,
the reference scheduler): one rank is a worker in this process, more (--tensor-parallel-size)
are Ray actors on a local Ray cluster (--ray: even for one). It tokenizes each prompt with the
checkpoint's tokenizer (``--chat``: through its chat template), generates until a stop token
(EOS from generation_config.json or config.json) or --max-new-tokens, and prints each completion.

Greedy unless --temperature is given; --top-p and --top-k narrow sampling, --seed makes it
repeatable (prompt i, sample j always draws the same tokens). --n samples N continuations of
each prompt: the prompt is computed once and forked (copy-on-write) into N sequences.

Output: in order of the prompts, each completion's text, streamed as it is generated (later
prompts' text waits for the earlier ones, so nothing interleaves); with several prompts or
samples each completion has a header line. --json prints one JSON object per line per prompt
and sample instead: prompt, prompt index, sample index, token_ids (generated only, a stop
token included), text (special tokens skipped) and finish_reason ("stop" or "length").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Optional, TextIO

from kvpager.commands import cli
from kvpager.numeric import ceil_div

DEFAULT_BLOCK_SIZE = 16


# How each completion is sampled: (flag, environment variable, type, default, metavar, help).
SAMPLING_FLAGS = (
    ("--max-new-tokens", "KVPAGER_MAX_NEW_TOKENS", cli.positive_int, 64, "N", "most tokens to generate per completion"),
    ("--temperature", "KVPAGER_TEMPERATURE", cli.non_negative_float, 0.0, "T", "sampling temperature; 0 is greedy"),
    ("--top-p", "KVPAGER_TOP_P", cli.fraction, 1.0, "P",
     "nucleus sampling: keep the most likely tokens holding probability P (1: off)"),
    ("--top-k", "KVPAGER_TOP_K", cli.non_negative_int, 0, "K", "sample among the K most likely tokens (0: off)"),
    ("--seed", "KVPAGER_SEED", cli.integer, 0, "S", "seed of the sampling (the same seed gives the same text)"),
    ("--n", "KVPAGER_N", cli.positive_int, 1, "N", "completions per prompt, forked from the computed prompt"),
)


def configure(parser: argparse.ArgumentParser) -> None:
    f = cli.flag
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="the text(s) to continue")
    f(parser, "--model", env="KVPAGER_MODEL", metavar="DIR", required=True,
      help="a local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)")
    cli.flag_table(parser, SAMPLING_FLAGS)
    f(parser, "--chat", env="KVPAGER_CHAT", type=bool, default=False,
      help="wrap each prompt as a user message in the checkpoint's chat template")
    f(parser, "--json", env="KVPAGER_JSON", type=bool, default=False,
      help="one JSON object per line per prompt and sample, no streaming")
    f(parser, "--tensor-parallel-size", env="KVPAGER_TENSOR_PARALLEL_SIZE", type=cli.positive_int, default=1,
      metavar="N", help="ranks: more than one runs them as Ray actors (one GPU each on CUDA)")
    f(parser, "--ray", env="KVPAGER_RAY", type=bool, default=False,
      help="run even a single rank as a Ray actor (a local Ray cluster starts: about 10 s more); without it one "
           "rank runs in this process")
    f(parser, "--no-ray", env="KVPAGER_NO_RAY", type=bool, default=False,
      help="one worker in this process, never Ray (the default for one rank)")
    cli.device_flag(parser, "CUDA when there is a GPU per rank")
    cli.dtype_flag(parser)
    cli.kv_cache_flags(parser)
    f(parser, "--max-model-len", env="KVPAGER_MAX_MODEL_LEN", type=cli.positive_int, metavar="N",
      default_help="the checkpoint's max_position_embeddings", help="longest sequence served (prompt + new tokens)")
    f(parser, "--num-gpu-blocks", env="KVPAGER_WORKER_NUM_GPU_BLOCKS", type=cli.positive_int, metavar="N",
      default_help="what the prompts need on the CPU; --memory-fraction of free memory on CUDA",
      help="KV cache blocks per rank")
    f(parser, "--memory-fraction", env="KVPAGER_WORKER_MEMORY_FRACTION", type=cli.fraction, default=0.8,
      metavar="X", help="fraction of free device memory (after the weights) for the cache on CUDA")


@dataclass(slots=True)
class Completion:
    """One sample of one prompt, as it is generated."""

    prompt_index: int
    sample: int
    detokenizer: object
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    printed: int = -1        # characters of text on the terminal; -1: not started (no header yet)


class Printer:
    """Prints completions in prompt order, streaming the earliest unfinished one: later ones
    wait (their text is kept) until every earlier one has finished."""

    def __init__(self, prompts: list[str], n: int, as_json: bool, out: TextIO) -> None:
        self.prompts, self.n, self.as_json, self.out = prompts, n, as_json, out
        self.headers = len(prompts) > 1 or n > 1
        self.order: list[Completion] = []
        self.cursor = 0  # index in order of the completion on the terminal now

    def update(self) -> None:
        while self.cursor < len(self.order):
            current = self.order[self.cursor]
            if not self.as_json:
                self._stream(current)
            if not current.finish_reason:
                break
            if self.as_json:
                self.out.write(json.dumps({
                    "prompt": self.prompts[current.prompt_index], "prompt_index": current.prompt_index,
                    "sample": current.sample, "token_ids": current.token_ids, "text": current.text,
                    "finish_reason": current.finish_reason}, ensure_ascii=False) + "\n")
            else:
                self.out.write("\n")
            self.cursor += 1
        self.out.flush()

    def _stream(self, c: Completion) -> None:
        if c.printed < 0:
            if self.headers:
                sample = f", sample {c.sample + 1}/{self.n}" if self.n > 1 else ""
                self.out.write(f"=== prompt {c.prompt_index + 1}{sample} ===\n")
            c.printed = 0
        self.out.write(c.text[c.printed:])
        c.printed = len(c.text)


def check_prompts(prompt_ids: list[list[int]], max_new_tokens: int, context_len: int,
                  block_size: int = DEFAULT_BLOCK_SIZE, gpu_blocks: Optional[int] = None) -> None:
    """Refuse, before anything starts, a prompt that encodes to nothing or does not fit the
    model's context with --max-new-tokens after it, or (``gpu_blocks``: --num-gpu-blocks) the
    KV cache: a completion that can never fit the pool would otherwise end in a worker's refused
    registration or the scheduler's "no progress"."""
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise cli.UsageError(f"prompt {i + 1} encodes to no tokens")
        if len(ids) + max_new_tokens > context_len:
            raise cli.UsageError(f"prompt {i + 1}: its {len(ids)} tokens and --max-new-tokens {max_new_tokens} "
                                 f"exceed the model's context of {context_len} tokens (--max-model-len)")
        need = ceil_div(len(ids) + max_new_tokens, block_size)
        if gpu_blocks is not None and need > gpu_blocks - 1:  # block 0 is the null block, never handed out
            raise cli.UsageError(f"prompt {i + 1}: its {len(ids)} tokens and --max-new-tokens {max_new_tokens} need "
                                 f"{need} KV cache blocks of {block_size} tokens; --num-gpu-blocks {gpu_blocks} "
                                 f"holds {max(0, gpu_blocks - 1)} (block 0 is reserved)")


def run(args: argparse.Namespace) -> int:
    # Of two flags that clash, the one typed wins over the other from the environment (cli.settle).
    if args.ray and args.no_ray and not cli.settle(args, "ray", "no_ray"):
        raise cli.UsageError("--ray and --no-ray: choose one")
    if args.no_ray and args.tensor_parallel_size != 1 and not cli.settle(args, "no_ray", "tensor_parallel_size"):
        raise cli.UsageError("--no-ray runs one worker in this process: --tensor-parallel-size must be 1")
    use_ray = args.ray or args.tensor_parallel_size > 1   # one rank: in this process, no Ray to start
    import torch

    from kvpager.embedded import embedded
    from kvpager.scheduler import Request, SamplingParams, Scheduler
    from kvpager.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
    from kvpager.worker.hf_config import UnsupportedModel
    from kvpager.worker.model import ModelConfig

    cuda = args.device != "cpu" and torch.cuda.device_count() >= args.tensor_parallel_size
    if args.device == "cuda" and not cuda:
        raise cli.Failure(f"--device cuda: {torch.cuda.device_count()} GPU(s) here, "
                          f"{args.tensor_parallel_size} needed")
    dtype = cli.resolve_dtype(args.dtype, cuda)
    try:
        tokenizer = Tokenizer.from_pretrained(args.model)
        model = ModelConfig.from_pretrained(args.model, dtype=dtype, max_model_len=args.max_model_len,
                                            kv_cache_dtype=args.kv_cache_dtype, kv_scale=args.kv_scale)
        model.check_tensor_parallel(args.tensor_parallel_size)  # before anything starts
    except (TokenizerError, UnsupportedModel, ValueError, OSError) as err:
        raise cli.Failure(f"cannot serve {args.model}: {cli.model_error_as_flags(cli.one_line(err))}") from err

    prompt_ids = [tokenizer.apply_chat_template(p) if args.chat else tokenizer.encode(p) for p in args.prompts]
    check_prompts(prompt_ids, args.max_new_tokens, model.context_len, DEFAULT_BLOCK_SIZE, args.num_gpu_blocks)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, n=args.n, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, stop_token_ids=tuple(sorted(tokenizer.eos_token_ids)))
    requests = [Request(f"prompt-{i}", ids, dataclasses.replace(params, seed=args.seed + i))
                for i, ids in enumerate(prompt_ids)]
    block_size = DEFAULT_BLOCK_SIZE
    gpu_blocks = args.num_gpu_blocks
    if gpu_blocks is None and not cuda:  # the CPU: just what these requests need, with room to spare
        need = sum(ceil_div(len(ids) + args.max_new_tokens, block_size) + 1 for ids in prompt_ids) * args.n
        gpu_blocks = max(64, 2 * need)

    printer = Printer(list(args.prompts), args.n, args.json, sys.stdout)
    completions: dict[tuple[str, int], Completion] = {}
    for i, request in enumerate(requests):
        for j in range(args.n):
            # Plain prompts: the text continues the prompt's (its leading space kept); chat: a reply.
            c = Completion(i, j, IncrementalDetokenizer(tokenizer, request.prompt, prompt_context=not args.chat))
            completions[(request.request_id, j)] = c
            printer.order.append(c)

    def on_token(request_id: str, sample: int, token: int, finish_reason: str) -> None:
        c = completions[(request_id, sample)]
        c.token_ids.append(token)
        c.text += c.detokenizer.push(token)
        if finish_reason:
            c.text += c.detokenizer.finish()
            c.finish_reason = finish_reason
        printer.update()

    try:
        system_context = embedded(model, block_size=block_size, tensor_parallel_size=args.tensor_parallel_size,
                                  use_ray=use_ray, num_gpu_blocks=gpu_blocks, num_cpu_blocks=64,
                                  memory_fraction=args.memory_fraction, device=None if cuda else "cpu")
        with system_context as system:
            scheduler = Scheduler(system.client, system.runner, block_size, on_token=on_token,
                                  max_model_len=model.max_model_len, overlap=True)
            try:
                for request in requests:
                    scheduler.add(request)
            except ValueError as err:
                raise cli.UsageError(str(err)) from err
            scheduler.run()
    except UnsupportedModel as err:
        raise cli.Failure(f"cannot serve {args.model}: {cli.one_line(err)}") from err
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return cli.run_main("kvpager generate", sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
