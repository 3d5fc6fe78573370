"""Compile kvpager's CUDA kernels ahead of time, where no GPU is visible (``docker build``).

``kvpager.kernels.cuda`` JIT-builds its extension on first use into ``$KVPAGER_EXT_DIR`` and
only tries when torch sees a CUDA device. Compiling needs no device, only nvcc and the target
architectures: this runs that same build (same sources, flags and folder) with torch's device
check answered yes, for the architectures in ``TORCH_CUDA_ARCH_LIST``. A worker started later
with the same ``KVPAGER_EXT_DIR``, ``TORCH_CUDA_ARCH_LIST`` and sources finds the build up to
date and loads it without compiling (deploy/worker.Dockerfile keeps both variables set).

    TORCH_CUDA_ARCH_LIST="8.0;9.0" KVPAGER_EXT_DIR=/opt/kvpager-ext python deploy/build_kernels.py
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    import torch

    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        print("build_kernels: set TORCH_CUDA_ARCH_LIST (e.g. 9.0): with no GPU visible nothing says "
              "which architectures to compile for", file=sys.stderr)
        return 2
    if not os.environ.get("KVPAGER_EXT_DIR"):
        print("build_kernels: set KVPAGER_EXT_DIR to the folder the workers will load the kernels from",
              file=sys.stderr)
        return 2
    if torch.version.cuda is None:
        print(f"build_kernels: torch {torch.__version__} is a CPU build; nothing to compile", file=sys.stderr)
        return 2

    from kvpager.kernels import cuda

    torch.cuda.is_available = lambda: True  # the compiler needs no device; the loader only asks
    started = time.monotonic()
    try:
        cuda.load()
    except RuntimeError as err:
        print(f"build_kernels: {err}", file=sys.stderr)
        return 1
    print(f"build_kernels: compiled for {os.environ['TORCH_CUDA_ARCH_LIST']} into "
          f"{os.environ['KVPAGER_EXT_DIR']} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
