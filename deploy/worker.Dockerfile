# Cache workers and the Ray head: kvpager with its ray and metrics extras on a CUDA PyTorch base,
# with kvpager's CUDA kernels compiled while the image is built. Build context is the repository
# root:
#   docker build -f deploy/worker.Dockerfile -t kvpager-worker .
#   docker build -f deploy/worker.Dockerfile --build-arg TORCH_CUDA_ARCH_LIST=9.0 -t kvpager-worker .
# The CPU flavour (no CUDA; the compose file's cpu profile) is the same file on a plain Python base,
# where the CPU build of torch is installed and no kernel is compiled:
#   docker build -f deploy/worker.Dockerfile --build-arg BASE_IMAGE=python:3.11-slim \
#       --build-arg BUILD_KERNELS=0 -t kvpager-worker-cpu .
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

# GPU architectures the kernels are compiled for (compute capabilities; +PTX lets newer GPUs
# JIT-compile the last one). The same value stays set at run time: torch's JIT loader then
# finds the build up to date and loads it instead of compiling again.
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0+PTX"
ARG BUILD_KERNELS=1
# Installed only where the base image has no torch (the CPU flavour), from PyTorch's CPU index.
ARG CPU_TORCH="torch==2.13.0"
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    KVPAGER_EXT_DIR=/opt/kvpager-ext

RUN python -c "import torch" 2>/dev/null || pip install --index-url "${CPU_TORCH_INDEX}" "${CPU_TORCH}"

# An editable install: the kernels are compiled from kernels/csrc, which must stay beside the
# Python modules. The base dependencies plus the ray, metrics and models extras; never the torch extra,
# so the base image's CUDA build of torch is kept (checked below). Ray 2.52 or later: the compose
# file runs Ray with token authentication (RAY_AUTH_MODE=token), which older Ray ignores.
WORKDIR /opt/kvpager
COPY pyproject.toml README.md ./
COPY kvpager ./kvpager
COPY manager ./manager
COPY worker ./worker
COPY kernels ./kernels
COPY deploy/build_kernels.py ./deploy/build_kernels.py
RUN torch_before="$(python -c 'import torch; print(torch.__version__)')" \
 && pip install ninja -e ".[ray,metrics,models]" "ray>=2.52" \
 && torch_after="$(python -c 'import torch; print(torch.__version__)')" \
 && if [ "$torch_before" != "$torch_after" ]; then \
        echo "installing kvpager replaced torch $torch_before with $torch_after" >&2; exit 1; fi \
 && kvpager worker --help > /dev/null

# No GPU is visible while an image builds; build_kernels.py compiles anyway (see its docstring).
RUN mkdir -p "${KVPAGER_EXT_DIR}" \
 && if [ "${BUILD_KERNELS}" = "1" ]; then python deploy/build_kernels.py; fi

# Ray, the workers and the JIT loader write under $HOME, /tmp and the extension folder.
RUN useradd --create-home --uid 10001 --shell /bin/bash kvpager \
 && chown -R kvpager "${KVPAGER_EXT_DIR}"
USER kvpager
WORKDIR /home/kvpager

# deploy/docker-compose.yml runs this image as the Ray head (`ray start --head`) and as a worker
# (`kvpager worker --join ...`); there is no single default role.
CMD ["kvpager", "--help"]
