"""Small (or benchmark-sized) Hugging Face checkpoints with seeded random weights, for tests, the
demo and benchmarks: a real checkpoint directory (config.json, generation_config.json,
safetensors, optionally a tokenizer) that transformers and kvpager both load.

``build_random_checkpoint`` makes the config with transformers' own config class for the model
type, so config.json is exactly what transformers writes, and fills every parameter from a
seeded generator. Weights are N(0, init_std) (default ``1 / sqrt(hidden_size)``, much larger
than transformers' 0.02 at small widths: logits come out O(1), so the top tokens are well
separated and greedy comparisons between implementations do not flip on float noise); norm
weights 1 + N(0, 0.1^2) and biases N(0, 0.1^2), so that they matter in comparisons too.

Two ways to write, the same files either way:

- small models (up to ``STREAM_ABOVE_BYTES``): ``AutoModelForCausalLM.from_config`` in the
  target dtype, filled, then ``save_pretrained(path, max_shard_size=...)``;
- larger ones (e.g. Llama-3.2-1B or Llama-3.1-8B shapes in bf16 for a GPU benchmark), or
  ``stream=True``: the model is instantiated on the ``meta`` device (names and shapes, no
  memory), then each tensor is generated (on ``device``: ``"cuda"`` is much faster for
  billions of weights), cast and written shard by shard with safetensors, with the
  ``model.safetensors.index.json`` transformers writes. Host memory peaks near one shard
  (``max_shard_size``, default 2 GB), never the whole model.

transformers is imported only inside the builder: the workers do not need it.
"""

from __future__ import annotations

import json
import math
import warnings
import zlib
from pathlib import Path
from typing import Any, Optional, Union

import torch

CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                  "qwen3": "Qwen3Config"}
STREAM_ABOVE_BYTES = 512 << 20
DEFAULT_SHARD_BYTES = 2 << 30


def build_random_checkpoint(path: Union[str, Path], model_type: str = "llama", *, num_layers: int = 2,
                            hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                            head_dim: Optional[int] = None, vocab_size: int = 512, intermediate_size: int = 128,
                            tie_word_embeddings: bool = False, dtype: str = "float32",
                            max_shard_size: Union[int, str, None] = None, seed: int = 0,
                            init_std: Optional[float] = None, tokenizer: bool = True, stream: Optional[bool] = None,
                            device: Union[str, torch.device] = "cpu", **config_overrides: Any) -> Path:
    """Write a random-weight checkpoint of ``model_type`` (llama, mistral, qwen2, qwen3) to
    ``path`` (created) and return it. ``config_overrides`` go to the transformers config class
    as they are (``rope_scaling``, ``rope_theta``, ``attention_bias``, ``mlp_bias``,
    ``max_position_embeddings``, ``sliding_window``, ``bos_token_id``, ``eos_token_id``...).
    Mistral's sliding window defaults to none here (transformers' default, 4096, would be
    refused for longer contexts). ``head_dim`` defaults to hidden_size // num_heads for every
    type (Qwen3's own default is 128). ``max_shard_size``: bytes or a string such as "200KB";
    several shards come with an index. ``tokenizer``: also save the test tokenizer
    (``kvpager.tokenizer_build``) when that module is there."""
    import transformers

    if model_type not in CONFIG_CLASSES:
        raise ValueError(f"model_type must be one of {', '.join(CONFIG_CLASSES)}, got {model_type!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    settings: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, initializer_range=init_std or 1 / math.sqrt(hidden_size))
    if model_type == "mistral":
        settings["sliding_window"] = None
    settings |= config_overrides
    config = getattr(transformers, CONFIG_CLASSES[model_type])(**settings)
    config.dtype = torch_dtype
    std = float(config.initializer_range)

    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]   # as save_pretrained writes it, streamed or not
    params = {name: (tuple(p.shape), p.dtype) for name, p in skeleton.named_parameters()}  # tied: once
    del skeleton
    total = sum(math.prod(shape) for shape, _ in params.values()) * torch_dtype.itemsize
    shard_bytes = _bytes(max_shard_size) if max_shard_size is not None else None
    if stream if stream is not None else total > STREAM_ABOVE_BYTES:
        _write_streaming(path, config, params, torch_dtype, std, seed, shard_bytes or DEFAULT_SHARD_BYTES,
                         torch.device(device))
    else:
        _write_with_transformers(path, config, torch_dtype, std, seed, shard_bytes)
    transformers.GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(
        path)
    if tokenizer:
        try:
            from kvpager.tokenizer_build import save_test_tokenizer
        except ImportError:
            warnings.warn("kvpager.tokenizer_build is not available: the checkpoint has no tokenizer", stacklevel=2)
        else:
            save_test_tokenizer(path, model_type, vocab_size)
    return path


def random_tensor(name: str, shape: tuple[int, ...], std: float, seed: int,
                  device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """Parameter ``name``'s random value (float32): a generator per (seed, name), so the value
    does not depend on the order tensors are made in, nor on the way the checkpoint is written."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 62)
    x = torch.randn(shape, generator=gen, device=device)
    if name.endswith("norm.weight"):
        return x.mul_(0.1).add_(1.0)
    return x.mul_(0.1 if name.endswith(".bias") else std)


def _write_with_transformers(path: Path, config, dtype: torch.dtype, std: float, seed: int,
                             shard_bytes: Optional[int]) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(random_tensor(name, tuple(p.shape), std, seed))
    was_enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        extra = {} if shard_bytes is None else {"max_shard_size": shard_bytes}
        model.save_pretrained(path, **extra)
    finally:
        if was_enabled:
            transformers.utils.logging.enable_progress_bar()


def _write_streaming(path: Path, config, params: dict[str, tuple[tuple[int, ...], torch.dtype]],
                     dtype: torch.dtype, std: float, seed: int, shard_bytes: int, device: torch.device) -> None:
    """Tensor by tensor: at most one shard's tensors in host memory at a time."""
    from safetensors.torch import save_file

    config.save_pretrained(path)
    groups: list[list[str]] = [[]]
    size = 0
    for name, (shape, _) in params.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    if len(groups) == 1:
        files = ["model.safetensors"]
    weight_map = {}
    for file, names in zip(files, groups):
        tensors = {name: random_tensor(name, params[name][0], std, seed, device).to(dtype).cpu() for name in names}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        del tensors
        weight_map |= {name: file for name in names}
    if len(groups) > 1:
        total = sum(math.prod(shape) for shape, _ in params.values())
        index = {"metadata": {"total_parameters": total, "total_size": total * dtype.itemsize},
                 "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _bytes(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit, factor in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10 ** 9), ("MB", 10 ** 6),
                         ("KB", 10 ** 3), ("B", 1)):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * factor)
    return int(text)
