"""What model a worker serves: ``ModelConfig``, read from a Hugging Face ``config.json``.

Supported: the Llama family of decoders that kvpager computes exactly as transformers does
(``worker.model``): ``llama`` (Llama 2, 3, 3.1, 3.2, with rope_scaling type ``llama3``, tied or
untied embeddings, ``attention_bias``, ``mlp_bias``), ``mistral``, ``qwen2`` (Qwen2, Qwen2.5:
q/k/v biases) and ``qwen3`` (per-head q/k RMSNorm); RoPE types default, linear, dynamic (within
max_position_embeddings, where its frequencies are the default ones) and llama3. Anything else,
or a feature the model code does not implement (another RoPE type, another activation, a
sliding window shorter than the served context, a quantized checkpoint...), raises
``UnsupportedModel`` with a one-line message naming it; nothing is approximated.

Both ways transformers writes RoPE settings are read: ``rope_theta`` + ``rope_scaling`` (hub
checkpoints) and ``rope_parameters`` (transformers 5), with transformers' precedence (see
``_rope``). Keys a config.json omits take the defaults of transformers' own config class for
that model type; a key given as null is refused where transformers refuses it (its config
fields are typed), so every config kvpager serves is one transformers loads.

``PRESETS`` are small models with seeded random weights (``path`` None), for tests and the demo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")


class UnsupportedModel(ValueError):
    """The model (its type or one of its features) is not one kvpager computes exactly."""

    def __init__(self, what: str) -> None:
        super().__init__(f"unsupported model: {what} (kvpager serves model types "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} with default, linear, dynamic or llama3 RoPE, SiLU MLPs and "
                         f"full causal attention)")


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """rope_type "llama3" (Llama 3.1, 3.2): low frequencies divided by ``factor``, a smooth
    ramp between ``low_freq_factor`` and ``high_freq_factor`` wavelengths."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class Rope:
    """How q and k are rotated: ``theta ** (-2i / freq_dim)`` for i < head_dim / 2, then scaled."""

    theta: float = 10000.0               # for dynamic NTK: its base at max_position_embeddings
    llama3: Optional[Llama3RopeScaling] = None
    linear_factor: Optional[float] = None  # rope_type "linear": every frequency divided by it
    # The exponent's denominator where it is not head_dim: transformers' linear, dynamic and
    # llama3 types use int(head_dim * partial_rotary_factor), which rotates the whole head only
    # when it is head_dim - 1 (or head_dim, kept as None).
    freq_dim: Optional[int] = None

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """The float32 inverse frequencies ``[head_dim / 2]``, as transformers computes them."""
        dim = self.freq_dim or head_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.linear_factor is not None:
            return inv / self.linear_factor
        s = self.llama3
        if s is None:
            return inv
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)

    # No RoPE type kvpager implements scales cos/sin (transformers' attention_scaling is 1).
    attention_scaling = 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # ---- the architecture (Hugging Face names in comments) ----
    model_type: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4                  # num_hidden_layers
    num_q_heads: int = 8                 # num_attention_heads
    num_kv_heads: int = 4                # num_key_value_heads
    head_dim: int = 32
    intermediate_size: int = 512
    rms_eps: float = 1e-5                # rms_norm_eps
    rope: Rope = field(default_factory=Rope)
    tie_word_embeddings: bool = False
    attention_bias: bool = False         # q/k/v projection biases
    o_proj_bias: bool = False            # output projection bias (Llama's attention_bias; Qwen2 has none)
    mlp_bias: bool = False               # gate/up/down biases
    qk_norm: bool = False                # Qwen3: RMSNorm of each q and k head before RoPE
    max_position_embeddings: int = 4096
    sliding_window: Optional[int] = None  # only a window >= the served context is accepted (no masking)
    max_model_len: Optional[int] = None   # the longest sequence served; None: no limit set
    # ---- how it runs ----
    dtype: str = "float32"               # weights and activations
    # KV cache storage: "auto" (the model's dtype) or "fp8_e4m3" (K / kv_scale and V / kv_scale
    # in float8_e4m3fn, half the bytes of a 16-bit cache; kv_scale per tensor, every layer).
    kv_cache_dtype: str = "auto"
    kv_scale: float = 1.0
    path: Optional[str] = None           # the checkpoint directory; None: seeded random weights
    seed: int = 0                        # of the random weights

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")
        if not 0 < self.kv_scale < float("inf"):
            raise ValueError(f"kv_scale must be finite and > 0, got {self.kv_scale}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"model_type {self.model_type!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise UnsupportedModel(f"{self.num_q_heads} attention heads are not a multiple of "
                                   f"{self.num_kv_heads} key/value heads")
        if self.head_dim % 2:
            raise UnsupportedModel(f"odd head_dim {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < self.context_len:
            raise UnsupportedModel(
                f"sliding_window {self.sliding_window} shorter than the served context of {self.context_len} "
                f"tokens (set max_model_len <= {self.sliding_window} to serve it with full attention)")

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise UnsupportedModel unless ``tp_size`` ranks split the heads (query and key/value)
        and the MLP evenly."""
        parts = {"attention heads": self.num_q_heads, "key/value heads": self.num_kv_heads,
                 "intermediate size": self.intermediate_size}
        bad = [f"{n} {what}" for what, n in parts.items() if n % tp_size]
        if tp_size < 1 or bad:
            raise UnsupportedModel(f"tensor_parallel_size {tp_size} does not divide the {' and '.join(bad)} "
                                   f"evenly")

    @property
    def context_len(self) -> int:
        """The longest sequence this config may serve: max_model_len, else max_position_embeddings."""
        return self.max_model_len if self.max_model_len is not None else self.max_position_embeddings

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8_e4m3" else self.torch_dtype

    @property
    def cache_scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) for the kernels: 1 unless the cache is fp8."""
        return (self.kv_scale, self.kv_scale) if self.kv_cache_dtype == "fp8_e4m3" else (1.0, 1.0)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: Optional[str] = None, max_model_len: Optional[int] = None,
                        kv_cache_dtype: str = "auto", kv_scale: float = 1.0, check_weights: bool = True
                        ) -> "ModelConfig":
        """The model of the checkpoint directory ``path`` (its config.json), computed in ``dtype``
        (default float32), serving sequences of up to ``max_model_len`` tokens (default the
        model's max_position_embeddings). Raises UnsupportedModel for a model kvpager does not
        serve and ``worker.checkpoint.CheckpointError`` (a ValueError) for a missing or broken
        config.json; with ``check_weights`` also for safetensors files that lack a tensor, hold
        one too many or a mis-shaped one (headers only: no weights are read)."""
        from . import checkpoint

        cfg = config_from_hf(checkpoint.read_config_json(path), dtype=dtype or "float32",
                             max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale,
                             path=str(Path(path).resolve()))
        if check_weights:
            checkpoint.open_weights(cfg)
        return cfg


# Keys a config.json may omit, per model type: transformers' class defaults (5.x). head_dim None:
# hidden_size // num_attention_heads; num_key_value_heads None: num_attention_heads.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                  mlp_bias=False, sliding_window=None),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                    max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    sliding_window=4096),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=None, hidden_act="silu",
                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
}


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32", max_model_len: Optional[int] = None,
                   kv_cache_dtype: str = "auto", kv_scale: float = 1.0, path: Optional[str] = None) -> ModelConfig:
    """``ModelConfig`` of a parsed config.json; UnsupportedModel names the first feature refused."""
    model_type = hf.get("model_type")
    if model_type not in _DEFAULTS:
        raise UnsupportedModel(f"model_type {model_type!r}")
    # transformers' config classes refuse null for their typed fields; those it accepts mean
    # something (no sliding window, as many key/value heads as heads, head_dim from the sizes).
    for key, value in hf.items():
        if value is None and key in _DEFAULTS[model_type] and key not in _NULLABLE[model_type]:
            raise UnsupportedModel(f"{key} None (a value expected: transformers refuses a null {key} too)")
    c = {**_DEFAULTS[model_type], **hf}
    for arch in hf.get("architectures") or ():
        if not str(arch).endswith("ForCausalLM"):
            raise UnsupportedModel(f"architecture {arch!r} (only ...ForCausalLM heads)")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?") if isinstance(hf["quantization_config"],
                                                                                  dict) else "?"
        raise UnsupportedModel(f"quantized checkpoint (quantization_config, quant_method {method!r})")
    if c["hidden_act"] not in ("silu", "swish"):
        raise UnsupportedModel(f"hidden_act {c['hidden_act']!r} (only silu)")
    heads = _int(c, "num_attention_heads")
    kv_heads = _int(c, "num_key_value_heads") if c["num_key_value_heads"] is not None else heads
    head_dim = _int(c, "head_dim") if c.get("head_dim") is not None else _int(c, "hidden_size") // heads
    max_pos = _int(c, "max_position_embeddings")
    if max_model_len is not None and max_model_len > max_pos:
        raise UnsupportedModel(f"max_model_len {max_model_len} beyond the model's max_position_embeddings {max_pos}")
    return ModelConfig(
        model_type=model_type, vocab_size=_int(c, "vocab_size"), hidden_size=_int(c, "hidden_size"),
        num_layers=_int(c, "num_hidden_layers"), num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=_int(c, "intermediate_size"), rms_eps=float(c["rms_norm_eps"]), rope=_rope(c, head_dim),
        tie_word_embeddings=_bool(c, "tie_word_embeddings"),
        attention_bias=model_type == "qwen2" or (model_type in ("llama", "qwen3") and _bool(c, "attention_bias")),
        o_proj_bias=model_type in ("llama", "qwen3") and _bool(c, "attention_bias"),
        mlp_bias=model_type == "llama" and _bool(c, "mlp_bias"), qk_norm=model_type == "qwen3",
        max_position_embeddings=max_pos,
        sliding_window=_sliding_window(model_type, c), max_model_len=max_model_len or max_pos, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale, path=path)


# The keys of _DEFAULTS whose config field is Optional in transformers' class (null accepted).
_NULLABLE: dict[str, frozenset[str]] = {
    "llama": frozenset({"num_key_value_heads", "head_dim", "sliding_window"}),   # llama reads no window
    "mistral": frozenset({"head_dim", "sliding_window"}),
    "qwen2": frozenset({"num_key_value_heads", "sliding_window"}),   # its head_dim is no field: null breaks RoPE
    "qwen3": frozenset({"num_key_value_heads", "sliding_window"}),
}


def _bool(c: dict[str, Any], key: str) -> bool:
    value = c.get(key, False)
    if not isinstance(value, bool):   # "false" is a true value in Python: never guess
        raise UnsupportedModel(f"{key} {value!r} (true or false expected)")
    return value


def _int(c: dict[str, Any], key: str) -> int:
    value = c.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModel(f"{key} {value!r} (a positive integer expected)")
    return value


def _rope(c: dict[str, Any], head_dim: int) -> Rope:
    # As transformers 5 reads them: a non-empty rope_scaling (the hub's older field) replaces
    # rope_parameters whole (nothing of rope_parameters is kept, not even its rope_theta); its
    # "type" is the older name of "rope_type". A key missing from the dict comes from the top
    # level of config.json (rope_theta, partial_rotary_factor), else the class default.
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel(f"rope parameters {params!r} (one flat dict expected)")
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise UnsupportedModel(f"rope_theta {theta!r} (a positive number expected)")
    theta = float(theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":   # these four models' default RoPE ignores partial_rotary_factor
        return Rope(theta)
    if rope_type not in ("linear", "dynamic", "llama3"):
        raise UnsupportedModel(f"rope_type {rope_type!r} (only default, linear, dynamic and llama3)")
    dim = _rotary_dim(params, c, head_dim, rope_type)
    freq_dim = None if dim == head_dim else dim
    if rope_type in ("linear", "dynamic"):
        if "factor" not in params:
            raise UnsupportedModel(f"{rope_type} rope scaling without factor")
        factor = _positive_number(params["factor"], f"{rope_type} rope scaling factor")
    if rope_type == "linear":
        return Rope(theta, linear_factor=float(factor), freq_dim=freq_dim)
    if rope_type == "dynamic":
        # Dynamic NTK rescales theta once a sequence passes max_position_embeddings (transformers
        # recomputes the frequencies at run time); kvpager serves no longer sequences
        # (max_model_len <= max_position_embeddings), where the base is this one, as transformers
        # computes it at that length.
        if dim == 2:
            raise UnsupportedModel("dynamic rope scaling over a rotary dim of 2 (transformers divides by zero)")
        max_pos = c["max_position_embeddings"]
        return Rope(theta * ((factor * max_pos / max_pos) - (factor - 1)) ** (dim / (dim - 2)), freq_dim=freq_dim)
    # A top-level original_max_position_embeddings (written by some Llama 3 fine-tunes) is put
    # over the dict's own when transformers computes the llama3 frequencies; then the dict's;
    # then max_position_embeddings. transformers computes with any number there; an integral
    # float (8192.0) is the integer it means, another one is refused.
    original = c["original_max_position_embeddings"] if "original_max_position_embeddings" in c else \
        params.get("original_max_position_embeddings", c["max_position_embeddings"])
    if isinstance(original, float) and original.is_integer():
        original = int(original)
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise UnsupportedModel(f"llama3 rope scaling with original_max_position_embeddings {original!r} "
                               f"(a positive integer expected)")
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]), original_max_position_embeddings=original)
    except KeyError as missing:
        raise UnsupportedModel(f"llama3 rope scaling without {missing.args[0]}") from None
    except (TypeError, ValueError):
        raise UnsupportedModel(f"llama3 rope scaling {params!r} (numbers expected)") from None
    if scaling.high_freq_factor == scaling.low_freq_factor:
        raise UnsupportedModel("llama3 rope scaling with high_freq_factor == low_freq_factor")
    return Rope(theta, scaling, freq_dim=freq_dim)


def _positive_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise UnsupportedModel(f"{what} {value!r} (a positive number expected)")
    return value


def _rotary_dim(params: dict[str, Any], c: dict[str, Any], head_dim: int, rope_type: str) -> int:
    """The dimension in the exponent of transformers' scaled RoPE types: int(head_dim *
    partial_rotary_factor), the rope dict's own factor over the top level's. Its model rotates
    all head_dim dims with 2 * ceil(dim / 2) frequencies, and fails on any other length."""
    if "partial_rotary_factor" in params:
        partial = params["partial_rotary_factor"]
    else:   # transformers drops a null at the top level (not in the dict)
        partial = 1.0 if c.get("partial_rotary_factor") is None else c["partial_rotary_factor"]
    dim = int(head_dim * _positive_number(partial, "partial_rotary_factor"))
    if dim not in (head_dim - 1, head_dim):
        raise UnsupportedModel(f"partial_rotary_factor {partial} with rope_type {rope_type!r} (rotates {dim} of "
                               f"{head_dim} head dims: transformers' model fails on it)")
    return dim


def _sliding_window(model_type: str, c: dict[str, Any]) -> Optional[int]:
    """The window some layer applies, as transformers decides it (None: every layer attends to
    the whole context)."""
    layer_types = _layer_types(model_type, c)
    window = c.get("sliding_window")
    if model_type == "llama":
        # Llama's attention masks no window, but transformers' cache keeps only the last
        # sliding_window tokens of a layer it thinks slides (all of them without layer_types), so
        # its generate() parts from its own forward: kvpager takes the window as it comes.
        sliding = "sliding_attention" in layer_types if layer_types is not None else window is not None
        if not sliding:
            return None
        if window is None:
            raise UnsupportedModel("layer_types with sliding_attention and no sliding_window (transformers' "
                                   "cache fails on it)")
        return _int(c, "sliding_window")
    if model_type in ("qwen2", "qwen3"):
        full = c["max_window_layers"]   # typed in transformers' config: checked whether used or not
        if isinstance(full, bool) or not isinstance(full, int):
            raise UnsupportedModel(f"max_window_layers {full!r} (an integer expected)")
        if not _bool(c, "use_sliding_window"):
            window = None                  # transformers drops the window
        if layer_types is None:
            sliding = window is not None and full < c["num_hidden_layers"]
        elif "sliding_attention" in layer_types and window is None:
            raise UnsupportedModel("layer_types with sliding_attention and no window (use_sliding_window false or "
                                   "sliding_window null: transformers' model fails on it)")
        else:
            sliding = "sliding_attention" in layer_types
        if not sliding:
            return None
    if window is None:
        return None
    return _int(c, "sliding_window")


def _layer_types(model_type: str, c: dict[str, Any]) -> Optional[list[str]]:
    """config.json's layer_types (None: not given) where transformers' model runs them: one per
    layer, each full or sliding attention ("attention" is its older name of full)."""
    layer_types = c.get("layer_types")
    if layer_types is None:
        return None
    if model_type == "mistral":
        raise UnsupportedModel("mistral with layer_types (transformers builds a ministral model for it)")
    if not isinstance(layer_types, list) or len(layer_types) != c["num_hidden_layers"]:
        raise UnsupportedModel(f"layer_types {layer_types!r} (a list of num_hidden_layers "
                               f"{c['num_hidden_layers']} layer types expected)")
    named = ["full_attention" if t == "attention" else t for t in layer_types]
    other = sorted({str(t) for t in named} - {"full_attention", "sliding_attention"})
    if other:
        raise UnsupportedModel(f"layer_types {', '.join(other)} (only full_attention and sliding_attention)")
    return named


# ---- seeded random-weight models -------------------------------------------------------------------
# The named models of `kvpager worker --model` and the demo: "tiny" runs anywhere; "small" has a
# head dim the CUDA decode kernel is built for (64, 128 or 256), so it is the default on GPUs.
PRESETS = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=16,
                        intermediate_size=256, seed=7),
    "small": ModelConfig(vocab_size=256, hidden_size=256, num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=64,
                         intermediate_size=512, seed=7),
}


def preset(name: str, kv_cache_dtype: str = "auto", kv_scale: float = 1.0) -> ModelConfig:
    """A named model (``PRESETS``) with the KV storage asked for."""
    model = PRESETS[name]
    if kv_cache_dtype == "auto":
        return model
    return replace(model, kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale)
