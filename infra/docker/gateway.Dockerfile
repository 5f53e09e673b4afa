# syntax=docker/dockerfile:1.7
# Gateway image. The same image runs the Celery workers (`mplex worker --queues ...`), beat (`mplex beat`)
# and migrations (`mplex db upgrade`): one build, one set of dependencies, different commands.
#   docker build -f infra/docker/gateway.Dockerfile -t mplex-gateway .      (from the repository root)
# Base images are pinned to exact tags; bump them deliberately.

# --- the browser app (tenant dashboard, admin, finance), served by the gateway as static files ---------------
FROM node:20.18.1-bookworm-slim AS web
WORKDIR /src/web
COPY web/package.json web/package-lock.json ./
RUN npm ci --no-audit --no-fund
COPY web/ ./
RUN npm run build

# --- Python environment --------------------------------------------------------------------------------------
FROM python:3.11.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# The CPU wheel of torch first, from the CPU index: the exact pin in requirements.lock is then already
# satisfied and nothing can pull a multi-GB CUDA build into a CPU image.
RUN python -m venv /opt/venv \
    && pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
WORKDIR /src
COPY requirements.lock ./
RUN pip install -r requirements.lock
COPY pyproject.toml README.md ./
COPY services/ services/
RUN pip install --no-deps . \
    && python -c "import services.cli"
# RDS presents certificates from the AWS RDS CA; the DSN verifies against this bundle (sslmode=verify-full).
RUN python -c "import urllib.request; urllib.request.urlretrieve('https://truststore.pki.rds.amazonaws.com/global/global-bundle.pem', '/opt/rds-global-bundle.pem')"

# --- runtime -------------------------------------------------------------------------------------------------
FROM python:3.11.11-slim-bookworm AS runtime
LABEL org.opencontainers.image.title="multiplex-gateway" \
      org.opencontainers.image.description="Multiplex gateway, Celery workers, beat and migrations"
RUN groupadd --system --gid 10001 mplex \
    && useradd --system --uid 10001 --gid mplex --home-dir /app --shell /usr/sbin/nologin mplex
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/rds-global-bundle.pem /etc/ssl/certs/rds-global-bundle.pem
COPY --from=web /src/web/dist /app/web/dist
COPY migrations/ /app/migrations/
COPY infra/docker/healthcheck.py /opt/mplex/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLEX_HOME=/var/lib/mplex \
    MPLEX_HEALTH_URL=http://127.0.0.1:8000/health
WORKDIR /app
USER 10001:10001
EXPOSE 8000 9100
# Workers and beat serve /health on 9100: run them with MPLEX_HEALTH_URL=http://127.0.0.1:9100/health.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "/opt/mplex/healthcheck.py"]
CMD ["mplex", "gateway", "serve", "--host", "0.0.0.0", "--port", "8000"]
