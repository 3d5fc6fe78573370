"""Building and loading kvpager's CUDA extension (kernels/csrc), once per process.

``torch.utils.cpp_extension`` JIT-builds the sources with ninja on first use and caches the
result in ``$KVPAGER_EXT_DIR`` if set, else ``<tempdir>/kvpager_ext/<torch>-<cuda>-<hash of the
sources, headers, TORCH_CUDA_ARCH_LIST and KVPAGER_EXT_CUDA_FLAGS>``, never inside the
repository. A failed build is remembered, so ``available()`` is cheap after the first call.
``kernels/cuda.py`` wraps what the module exports; ``deploy/build_kernels.py`` calls ``load()``
to build ahead of time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from types import ModuleType

import torch

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("binding.cpp", "binding_decode.cpp", "binding_prefill.cpp", "binding_cache_ops.cpp", "binding_layer_ops.cpp",
            "decode_stage_binding.cpp", "decode_stage.cpp", "launch.cu", "decode_plan.cu", "layer_ops.cu",
            "paged_prefill.cu")
_HEADERS = ("launch.h", "decode_plan.h", "decode_stage.h", "paged_decode.cuh", "paged_decode_merge.cuh",
            "paged_decode_mma.cuh", "paged_decode_bulk.cuh", "mbarrier.cuh", "pdl.cuh", "cache_ops.cuh", "layer_ops.h", "paged_prefill.cuh", "paged_prefill_ws.cuh",
            "prefill_tensor_ops.cuh", "prefill_ws_shared.cuh", "prefill_ws_query.cuh", "prefill_ws_producer.cuh", "split_query.cuh",
            "fp8_convert.cuh", "pair_of.cuh", "mma_sync.cuh", "binding_checks.h", "decode_timeline.cuh")

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None

def _extra_cuda_flags() -> list[str]:
    """Extra nvcc flags for experiments (e.g. ``-DKVPAGER_DECODE_ROWS=8``, see paged_decode.cuh),
    from KVPAGER_EXT_CUDA_FLAGS; part of the build cache key."""
    return os.environ.get("KVPAGER_EXT_CUDA_FLAGS", "").split()


def _build_dir() -> Path:
    explicit = os.environ.get("KVPAGER_EXT_DIR")
    if explicit:
        return Path(explicit)
    digest = hashlib.sha256(" ".join(_extra_cuda_flags() + [os.environ.get("TORCH_CUDA_ARCH_LIST", "")]).encode())
    for name in _SOURCES + _HEADERS:
        digest.update(name.encode())
        digest.update((_CSRC / name).read_bytes())
    tag = f"{torch.__version__}-{torch.version.cuda}-{digest.hexdigest()[:16]}".replace("+", "_")
    return Path(tempfile.gettempdir()) / "kvpager_ext" / tag


def load() -> ModuleType:
    """The built extension module (building it on the first call); RuntimeError saying why not."""
    global _module, _error
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise RuntimeError(_error)
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available")
            from torch.utils import cpp_extension

            if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.get_device_capability() == (9, 0):
                # Hopper: build for sm_90a, so that the prefill kernel's wgmma instances exist.
                os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
            build = _build_dir()
            build.mkdir(parents=True, exist_ok=True)
            _module = cpp_extension.load(
                name="kvpager_cuda_ext",
                sources=[str(_CSRC / s) for s in _SOURCES],
                extra_include_paths=[str(_CSRC)],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo", "--expt-relaxed-constexpr", *_extra_cuda_flags()],
                build_directory=str(build),
                verbose=os.environ.get("KVPAGER_EXT_VERBOSE") == "1",
            )
        except Exception as exc:  # remember why, so available() is cheap afterwards
            _error = f"kvpager CUDA kernels unavailable: {type(exc).__name__}: {exc}"
            raise RuntimeError(_error) from exc
        return _module


def available() -> bool:
    """True when a CUDA device is visible and the extension builds (or is cached) and loads.
    The first call may take a minute (the JIT build); later calls are free."""
    if _module is not None:
        return True
    if _error is not None or not torch.cuda.is_available():
        return False
    if shutil.which("ninja") is None and not _ninja_module():
        return False
    try:
        load()
    except RuntimeError:
        return False
    return True


def load_error() -> str | None:
    """Why the extension could not be built or loaded, if it could not."""
    return _error


def _ninja_module() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    return True
