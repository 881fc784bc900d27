# syntax=docker/dockerfile:1.7
# crs-consumer container image.
#
#   docker build -t crs-consumer .
#   docker run --rm -p 8080:8080 -e KAFKA_BOOTSTRAP_SERVERS=... crs-consumer          # run
#   docker run --rm crs-consumer check                                                # check
#   docker build --target demo -t crs-consumer-demo .   # the demo/seeding tool (compose `seed`)
#
# Two stages: the builder installs the locked runtime dependencies into a pip-less venv at
# /opt/venv, then turns pyproject.toml + service/ into a wheel and adds it (no dev extra);
# the final stage is a clean python:3.11-slim with that venv copied in, no compilers, no
# build tools. deploy/check-dockerfile-steps.sh repeats the builder's steps without Docker:
# keep the two in step (it reads the COPY lines below).
#
# Reproducible: every Python package comes from requirements.lock (runtime) or
# requirements-build.lock (the build backend), pinned with hashes (pip --require-hashes);
# regenerate both with deploy/lock.sh after changing pyproject.toml (tests/unit/test_lock.py
# fails on drift). The base image is pinned by tag AND by the digest of its multi-platform
# index; the digest wins, the tag says what it is. To update it:
#   docker buildx imagetools inspect python:3.11-slim-bookworm   # newest 3.11.x: tag + "Digest:"
# then put the new tag and index digest below (and rebuild, and run the tests).
#
# The demo tool (tools/demo) goes only into the `demo` target, built on top of the builder's
# venv; the runtime stage, the default target and last stage, never contains it.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

# ---------------------------------------------------------------- builder
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
# Dependencies first: this layer is rebuilt only when a lock file changes.
COPY requirements.lock requirements-build.lock ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip install --require-hashes --no-deps -r requirements-build.lock \
    && python -m venv --without-pip /opt/venv \
    && python -m pip --python /opt/venv/bin/python install --require-hashes --no-deps \
       -r requirements.lock

# Only what the wheel is built from (see .dockerignore); README* may be absent.
COPY pyproject.toml README* ./
COPY service/ service/
# --no-deps everywhere: nothing is resolved here, `pip check` proves the lock is complete.
RUN python -m pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
    && python -m pip --python /opt/venv/bin/python install --no-deps /wheels/*.whl \
    && python -m pip --python /opt/venv/bin/python check \
    && /opt/venv/bin/crs-consumer --help >/dev/null

# ---------------------------------------------------------------- demo (--target demo only)
FROM builder AS demo-builder
COPY tools/demo/ /src/tools/demo/
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip wheel --no-deps --no-build-isolation --wheel-dir /demo-wheels ./tools/demo \
    && python -m pip --python /opt/venv/bin/python install --no-deps /demo-wheels/*.whl \
    && /opt/venv/bin/crs-consumer-demo --help >/dev/null

FROM ${PYTHON_IMAGE} AS demo

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH

RUN groupadd --system --gid 10001 crs \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin crs

COPY --from=demo-builder /opt/venv /opt/venv

USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["crs-consumer-demo"]
CMD ["seed"]

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="crs-consumer" \
      org.opencontainers.image.description="Committed-resource slot recorder for the Cortex scheduler of OpenStack Nova" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    CRS_HTTP_HOST=0.0.0.0 \
    CRS_HTTP_PORT=8080

RUN groupadd --system --gid 10001 crs \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin crs

COPY --from=builder /opt/venv /opt/venv

USER 10001:10001
WORKDIR /tmp
EXPOSE 8080

# No curl in slim: python's urllib. A non-2xx answer raises, so the exit code is the verdict.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('CRS_HTTP_PORT', '8080'), timeout=4)"]

ENTRYPOINT ["crs-consumer"]
CMD ["run"]
