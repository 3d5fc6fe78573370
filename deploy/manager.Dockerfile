# The block manager: pure Python (grpcio, protobuf, prometheus-client); no torch, no Ray, no CUDA.
# Build context is the repository root:
#   docker build -f deploy/manager.Dockerfile -t kvpager-manager .
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The package is one distribution; the worker and kernel modules come along as files but the
# manager never imports them. Only the base dependencies, the metrics extra and `cryptography`
# (for `python -m kvpager.devcerts`, which the compose file's certs service runs) are installed
# (not the torch or ray extras), and the build fails if torch or Ray found their way in.
COPY pyproject.toml README.md /tmp/kvpager/
COPY kvpager /tmp/kvpager/kvpager
COPY manager /tmp/kvpager/manager
COPY worker /tmp/kvpager/worker
COPY kernels /tmp/kvpager/kernels
RUN pip install "/tmp/kvpager[metrics]" "cryptography>=42" \
 && rm -rf /tmp/kvpager \
 && kvpager manager --help > /dev/null \
 && python -c "import kvpager.manager.service, kvpager.healthcheck, kvpager.devcerts, prometheus_client, cryptography" \
 && if python -c "import torch" 2>/dev/null || python -c "import ray" 2>/dev/null; then \
        echo "the manager image must not contain torch or ray" >&2; exit 1; fi \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvpager \
 && install -d -o kvpager -g kvpager -m 0700 /var/lib/kvpager

USER kvpager
WORKDIR /tmp
EXPOSE 50051 9400

# Every setting reads KVPAGER_* (see `kvpager manager --help`); deploy/docker-compose.yml
# passes the ports as flags and the pool settings as variables.
ENV KVPAGER_HOST=0.0.0.0 \
    KVPAGER_PORT=50051 \
    KVPAGER_METRICS_HOST=0.0.0.0 \
    KVPAGER_METRICS_PORT=9400

# Through the standard gRPC health protocol: SERVING, or NOT_SERVING while a worker rank is missing
# (plaintext: a TLS deployment overrides it, as deploy/docker-compose.yml does with --tls-ca).
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD python -m kvpager.healthcheck "127.0.0.1:${KVPAGER_PORT}"

CMD ["kvpager", "manager"]
