# syntax=docker/dockerfile:1.7
# Engine image: CUDA runtime, torch built for CUDA, Triton (JIT-compiles the SGMV/FP8 kernels on the GPU).
# Also runs the GPU Celery worker of the adapter quality gate (`mplex worker --queues adapters.eval`).
#   docker build -f infra/docker/engine.Dockerfile -t mplex-engine .      (from the repository root)
# Base images are pinned to exact tags; bump them deliberately.

FROM ghcr.io/astral-sh/uv:0.5.11 AS uv

# --- Python environment --------------------------------------------------------------------------------------
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS build
ARG PYTHON_VERSION=3.11.11
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
COPY --from=uv /uv /usr/local/bin/uv
# A relocatable CPython 3.11 (the distro ships another minor version), installed where the runtime stage
# copies it from; the venv on top holds everything else.
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    PATH=/opt/venv/bin:$PATH
RUN uv python install ${PYTHON_VERSION} \
    && uv venv --python ${PYTHON_VERSION} /opt/venv
# torch from the CUDA index first (with the triton build it was compiled against), then the locked rest.
RUN uv pip install --python /opt/venv/bin/python --index-url ${TORCH_INDEX} torch==2.13.0
WORKDIR /src
COPY requirements.lock ./
RUN uv pip install --python /opt/venv/bin/python -r requirements.lock
COPY pyproject.toml README.md ./
COPY services/ services/
RUN uv pip install --python /opt/venv/bin/python --no-deps . \
    && python -c "import services.cli, torch, triton"
RUN python -c "import urllib.request; urllib.request.urlretrieve('https://truststore.pki.rds.amazonaws.com/global/global-bundle.pem', '/opt/rds-global-bundle.pem')"

# --- runtime -------------------------------------------------------------------------------------------------
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS runtime
LABEL org.opencontainers.image.title="multiplex-engine" \
      org.opencontainers.image.description="Multiplex inference engine (CUDA)"
# Triton builds a small C launcher per kernel signature at first use: it needs a C compiler and libc headers.
# Unpinned on purpose (DL3008): the base tag fixes the Ubuntu release; apt then brings its security fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 mplex \
    && useradd --system --uid 10001 --gid mplex --home-dir /app --shell /usr/sbin/nologin mplex
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/rds-global-bundle.pem /etc/ssl/certs/rds-global-bundle.pem
COPY infra/docker/healthcheck.py /opt/mplex/healthcheck.py
COPY infra/docker/engine_drain.py /opt/mplex/engine_drain.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLEX_HOME=/var/lib/mplex \
    MPLEX_HEALTH_URL=http://127.0.0.1:8100/health \
    TRITON_CACHE_DIR=/tmp/triton \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /app
USER 10001:10001
EXPOSE 8100
# Loading a large checkpoint takes minutes: the start period covers it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/mplex/healthcheck.py"]
CMD ["mplex", "engine", "serve", "--model", "/models/base", "--host", "0.0.0.0", "--port", "8100", "--device", "cuda"]
