# syntax=docker/dockerfile:1
# Kiln inference server image.
#
#   docker build -t kiln .                                              # CUDA 13 runtime base, kiln[gpu]
#   docker build --build-arg BASE=python:3.12-slim -t kiln:cpu .        # CPU only (no CUDA libraries)
#   docker run --gpus all -p8000:8000 -p8001:8001 -p8002:8002 -v $PWD/models:/models kiln
#   docker run -p8000:8000 -p8001:8001 -p8002:8002 -v $PWD/models:/models kiln:cpu
#
# Extra `docker run` arguments are appended to `kiln serve --model-repository /models` (e.g. --log-verbose 1).
# tests/deploy/test_image.py builds a venv exactly as the runtime stage does and runs this ENTRYPOINT.

ARG BASE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
ARG BUILDER=python:3.12-slim

# ---- builder: the wheel, nothing else leaves this stage ----
FROM ${BUILDER} AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine_core ./engine_core
COPY server ./server
COPY cuda_kernels ./cuda_kernels
COPY load_tests ./load_tests
COPY kiln_cli.py ./
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# ---- runtime ----
FROM ${BASE} AS runtime
ARG BASE
# EXTRAS=auto: "gpu,llm" on a CUDA base image, "llm" otherwise; or name them (EXTRAS=gpu, EXTRAS=none)
ARG EXTRAS=auto
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/kiln \
    PATH=/opt/kiln/bin:$PATH \
    KILN_CACHE_DIR=/cache \
    KILN_HTTP_PORT=8000 \
    KILN_DRAIN_TIMEOUT_S=30 \
    KILN_DRAIN_DELAY_S=0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# CUDA images have no Python: take the distribution's (3.12 on Ubuntu 24.04); python:* images already have one.
# Not pinned: the version follows BASE, which is the pin (DL3008).
# hadolint ignore=DL3008
RUN if ! python3 -c "import ensurepip, venv" > /dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/kiln \
    && groupadd --system --gid 10001 kiln \
    && useradd --system --uid 10001 --gid kiln --create-home --home-dir /home/kiln kiln \
    && mkdir -p /models /cache \
    && chown kiln:kiln /cache

COPY --from=builder /dist /tmp/dist
RUN case "${EXTRAS}" in \
        auto) case "${BASE}" in *cuda*) extras="[gpu,llm]" ;; *) extras="[llm]" ;; esac ;; \
        none|"") extras="" ;; \
        *) extras="[${EXTRAS}]" ;; \
    esac \
    && wheel="$(ls /tmp/dist/kiln-*.whl)" \
    && pip install --no-cache-dir "kiln${extras} @ file://${wheel}" \
    && rm -rf /tmp/dist \
    && kiln --help > /dev/null

USER 10001:10001
WORKDIR /home/kiln
VOLUME ["/cache"]
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/ready' % os.environ.get('KILN_HTTP_PORT', '8000'), timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["kiln", "serve", "--model-repository", "/models"]
