"""CPU-CI check that the torch bindings of the CUDA kernels (binding*.cpp, with binding_checks.h)
parse and type-check against this torch's headers (g++ -fsyntax-only): the extension itself is
built only on a GPU machine. Apart from test_kernel_sources_compile.py (nvcc, run last on its
own): these are one g++ process each at the lowest priority, which can run beside the Ray tests,
so they start early (tests/conftest.py, LONGEST_FIRST). Skipped without nvcc and g++."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "kernels" / "csrc"


# Stand-ins for the two headers the CPU wheel and this toolkit cannot compile (the wheel lacks
# c10/cuda/impl/cuda_cmake_macros.h; ATen/cuda/CUDAContext.h needs cuBLAS and cuSPARSE headers):
# the bindings use only the current stream from the latter.
_STUBS = {
    "c10/cuda/impl/cuda_cmake_macros.h": "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n",
    "ATen/cuda/CUDAContext.h": ("#pragma once\n#include <c10/cuda/CUDAStream.h>\n"
                                "namespace at { namespace cuda { using c10::cuda::getCurrentCUDAStream; } }\n"),
}


def _cuda_includes() -> list[str]:
    """nvcc's own include flags (where cuda_runtime.h is), from its dry run."""
    out = subprocess.run(["nvcc", "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull], capture_output=True,
                         text=True, timeout=60)
    for line in out.stderr.splitlines():
        if 'INCLUDES="' in line:
            flags = line.split('INCLUDES="', 1)[1].split('"', 1)[0].split()
            if any(f.startswith("-I") for f in flags):
                return [f for f in flags if f.startswith("-I")]
    return []


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("g++") is None, reason="needs nvcc and g++")
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*binding*.cpp")))
def test_torch_binding_compiles(tmp_path, source):
    """The torch bindings parse and type-check against this torch's headers (g++ -fsyntax-only,
    warnings of our own files as errors): the extension itself is built only on a GPU machine."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    for name, text in _STUBS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-I", str(tmp_path),
           *[f"-I{p}" for p in include_paths()], *_cuda_includes(), f"-I{sysconfig.get_paths()['include']}",
           "-DTORCH_EXTENSION_NAME=kvpager_syntax", "-DTORCH_API_INCLUDE_EXTENSION_H", str(CSRC / source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=lambda: os.nice(19))
    ours = [line for line in proc.stderr.splitlines() if str(CSRC) in line and ("error" in line or "warning" in line)]
    assert proc.returncode == 0 and not ours, proc.stderr[-4000:]
