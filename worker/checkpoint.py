"""A rank's shard of the weights: read from a Hugging Face safetensors checkpoint, or made from a
seed (``ModelConfig.path`` None), under the same Hugging Face names and layout, so both take one
path through the tensor-parallel split.

Loading checks the whole checkpoint first, from the safetensors headers only: every tensor the
model needs is there (in the file the index names), with its expected shape and a float dtype,
and no other tensor is (a tensor the model would silently ignore means a model it does not
compute; only known harmless ones such as ``rotary_emb.inv_freq`` are skipped). Then each rank
reads just its slices (``safe_open(...).get_slice``), tensor by tensor, converting each to the
target dtype and device as it is read: a rank's peak host memory stays near its shard's size,
never the full state dict. Every problem raises ``CheckpointError`` naming the file or tensor.

The tensor-parallel split (Megatron): rank r of N keeps the rows of q/k/v (by heads; biases
follow), gate and up of its slice, the columns of o_proj and down_proj of its slice, and the
vocabulary rows [r * ceil(V / N), (r + 1) * ceil(V / N)) of the embedding and lm_head (the last
slice may be short). Norms and the biases of o_proj and down_proj (added after the all-reduce)
are whole on every rank.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch

from kvpager.numeric import ceil_div

if TYPE_CHECKING:
    from .hf_config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model does not read and needs not: RoPE buffers.
HARMLESS = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as it is; the message names the file or tensor."""


@dataclass(frozen=True, slots=True)
class Slice:
    """What a rank reads of one tensor: ``[start, stop)`` along ``dim`` (dim None: all of it)."""

    dim: Optional[int] = None
    start: int = 0
    stop: int = 0


def read_config_json(path: Union[str, Path]) -> dict:
    """The parsed config.json of a checkpoint directory."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (a local checkpoint directory is expected)")
    config = directory / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{config}: no config.json in the checkpoint directory")
    try:
        parsed = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{config}: unreadable ({err})") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{config}: a JSON object expected, found {type(parsed).__name__}")
    return parsed


# ---- the layout -----------------------------------------------------------------------------------
def expected_shapes(cfg: "ModelConfig") -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, by its Hugging Face name, with its full shape."""
    h, d, i, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_q_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if cfg.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (h,)}
    return shapes


def vocab_range(vocab_size: int, rank: int, tp_size: int) -> tuple[int, int, int]:
    """(start, stop, rows per rank) of rank's vocabulary slice; ``stop - start`` may fall short
    of the rows per rank on the last ranks (the model pads with zero rows)."""
    per_rank = ceil_div(vocab_size, tp_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size), per_rank


def shard_plan(cfg: "ModelConfig", rank: int, tp_size: int) -> dict[str, Slice]:
    """What rank ``rank`` of ``tp_size`` reads of each tensor of ``expected_shapes``."""
    d = cfg.head_dim
    q, kv = cfg.num_q_heads * d // tp_size, cfg.num_kv_heads * d // tp_size
    i = cfg.intermediate_size // tp_size
    start, stop, _ = vocab_range(cfg.vocab_size, rank, tp_size)
    split = {"q_proj": (0, q), "k_proj": (0, kv), "v_proj": (0, kv), "gate_proj": (0, i), "up_proj": (0, i),
             "o_proj": (1, q), "down_proj": (1, i)}
    plan = {}
    for name, shape in expected_shapes(cfg).items():
        module, kind = name.rsplit(".", 2)[-2:]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            plan[name] = Slice(0, start, stop)
        elif module in split and (kind == "weight" or split[module][0] == 0):
            dim, width = split[module]
            plan[name] = Slice(dim, rank * width, (rank + 1) * width)
        else:
            plan[name] = Slice()
    return plan


# ---- sources ----------------------------------------------------------------------------------------
class SafetensorsCheckpoint:
    """The safetensors files of a checkpoint directory: ``model.safetensors``, or the shards
    ``model.safetensors.index.json`` names. Reads headers on construction (no weights)."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            files = self._read_index(index)
        elif (self.path / SINGLE_FILE).is_file():
            files = {SINGLE_FILE: None}
        else:
            others = sorted(p.name for p in self.path.glob("*.bin")) if self.path.is_dir() else []
            hint = f" ({', '.join(others)}: PyTorch pickles are not loaded, only safetensors)" if others else ""
            raise CheckpointError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
        # name -> (file, shape, safetensors dtype); a name the index lists is looked up in its file.
        self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for file, listed in files.items():
            header = self._header(file)
            for name in listed or ():
                if name not in header:
                    raise CheckpointError(f"tensor {name}: {INDEX_FILE} puts it in {file}, which does not hold it")
                self.tensors[name] = (file, *header[name])
            for name, (shape, dtype) in header.items():
                self.tensors.setdefault(name, (file, shape, dtype))

    def _read_index(self, index: Path) -> dict[str, list[str]]:
        """Shard file -> the tensors the index puts there."""
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: unreadable index ({type(err).__name__}: {err})") from None
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(str(file), []).append(name)
        for file in files:
            if "/" in file or file.startswith(".") or not (self.path / file).is_file():
                raise CheckpointError(f"{index} names shard {file}, which is not in {self.path}")
        return files

    def _header(self, file: str) -> dict[str, tuple[tuple[int, ...], str]]:
        from safetensors import safe_open

        try:
            with safe_open(self.path / file, framework="pt") as f:
                return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                        for name in f.keys()}
        except Exception as err:  # SafetensorError (truncated, corrupt header) or OSError
            raise CheckpointError(f"{self.path / file}: not a readable safetensors file ({err})") from None

    def check(self, expected: dict[str, tuple[int, ...]], ignore: frozenset[str] = frozenset()) -> None:
        """Raise CheckpointError unless the checkpoint holds exactly the ``expected`` tensors
        (with those shapes and a float dtype), plus harmless ones and those in ``ignore``."""
        missing = [name for name in expected if name not in self.tensors]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise CheckpointError(f"{self.path}: missing tensor {missing[0]}{more}")
        unexpected = sorted(name for name in self.tensors
                            if name not in expected and name not in ignore and not HARMLESS.search(name))
        if unexpected:
            listed = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
            raise CheckpointError(f"{self.path}: unexpected tensor(s) the model does not use: {listed} "
                                  f"(in {self.tensors[unexpected[0]][0]})")
        for name, shape in expected.items():
            file, found, dtype = self.tensors[name]
            if found != shape:
                raise CheckpointError(f"tensor {name} in {file}: expected shape {list(shape)}, found {list(found)}")
            if dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"tensor {name} in {file}: dtype {dtype} (float32, float16 or bfloat16 "
                                      "expected; quantized checkpoints are not supported)")

    def read(self, name: str, part: Slice) -> torch.Tensor:
        """The part of tensor ``name``, in its checkpoint dtype on the CPU: a view of the mapped
        file (safetensors maps it; nothing is read until the view is copied), which keeps the
        mapping alive only as long as the view lives."""
        from safetensors import safe_open

        file = self.tensors[name][0]
        try:
            with safe_open(self.path / file, framework="pt") as f:
                if part.dim is None:
                    return f.get_tensor(name)
                view = f.get_slice(name)
                return view[part.start:part.stop] if part.dim == 0 else view[:, part.start:part.stop]
        except Exception as err:
            raise CheckpointError(f"tensor {name} in {self.path / file}: unreadable ({err})") from None


class RandomWeights:
    """Seeded random weights under the Hugging Face names: each tensor from its own generator
    (the config's seed and the tensor's name), so every rank makes the same full tensor and
    keeps its slice. Scales keep activations O(1): weights N(0, 1/fan_in), the embedding N(0, 1),
    norm weights 1 + N(0, 0.01), biases N(0, 0.01)."""

    def __init__(self, cfg: "ModelConfig") -> None:
        self.seed = cfg.seed
        self.tensors = {name: ("<random>", shape, "F32") for name, shape in expected_shapes(cfg).items()}

    def check(self, expected: dict[str, tuple[int, ...]], ignore: frozenset[str] = frozenset()) -> None:
        pass

    def read(self, name: str, part: Slice) -> torch.Tensor:
        shape = self.tensors[name][1]
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 62)
        full = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            full = 1 + 0.1 * full
        elif name.endswith(".bias"):
            full = 0.1 * full
        elif name != "model.embed_tokens.weight":
            full = full / shape[1] ** 0.5
        if part.dim is None:
            return full
        return full.narrow(part.dim, part.start, part.stop - part.start)


def open_weights(cfg: "ModelConfig") -> Union[SafetensorsCheckpoint, RandomWeights]:
    """The weights of ``cfg``, checked (headers only) against what the model reads."""
    if cfg.path is None:
        return RandomWeights(cfg)
    source = SafetensorsCheckpoint(cfg.path)
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding): unused.
    source.check(expected_shapes(cfg), frozenset({"lm_head.weight"}) if cfg.tie_word_embeddings else frozenset())
    return source


def load_shard(cfg: "ModelConfig", rank: int = 0, tp_size: int = 1,
               device: Union[str, torch.device] = "cpu") -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slices of every tensor (``shard_plan``), by Hugging Face name, in the
    config's dtype on ``device``. Checks the whole checkpoint before reading any weight."""
    source = open_weights(cfg)
    dtype, device = cfg.torch_dtype, torch.device(device)
    shard = {}
    for name, part in shard_plan(cfg, rank, tp_size).items():
        view = source.read(name, part)
        # One copy into memory of our own, converting as it goes: only the slice's bytes are
        # read, and the file's pages leave this process with the view.
        shard[name] = torch.empty(view.shape, dtype=dtype, device=device).copy_(view)
        del view
    return shard
