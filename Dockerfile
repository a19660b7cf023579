# spot-runner image. The base only needs a `python3` (3.11+) on PATH that imports torch: a
# PyTorch CUDA runtime image in production, a local Debian base with the CPU wheel in tests
# (scripts/build-base-image.sh). Build with BuildKit: DOCKER_BUILDKIT=1 docker build .
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

# --- builder: turn the source tree into a wheel; build tools stay in this stage -------------
FROM ${BASE_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# README* so a checkout without the README still builds (pyproject names it as readme).
COPY pyproject.toml README* ./
COPY runner ./runner
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m pip wheel --no-deps --wheel-dir /wheels .

# --- final: the runtime only ---------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG DUMB_INIT_VERSION=1.2.5.post1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RUNNER_RUN_DIR=/data/run \
    RUNNER_METRICS_PORT=9400

# The project installs into the base's own Python environment, where torch already is, so pip
# never resolves (and downloads) another torch. dumb-init comes from PyPI as a static binary so
# one recipe works on Debian, Ubuntu and conda-based images alike; the pip cache is a BuildKit
# cache mount and the wheel a bind mount (on /mnt, which exists in every base): neither
# lands in a layer.
RUN --mount=type=bind,from=builder,source=/wheels,target=/mnt \
    --mount=type=cache,target=/root/.cache/pip \
    python3 -m pip install /mnt/*.whl "dumb-init==${DUMB_INIT_VERSION}" \
    && python3 -c "import runner, torch" \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin runner \
    && mkdir -p /data/run \
    && chown -R 10001:10001 /data

COPY docker/healthcheck.py /usr/local/lib/spot-runner/healthcheck.py

# Numeric so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
USER 10001:10001
WORKDIR /data
EXPOSE 9400
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "/usr/local/lib/spot-runner/healthcheck.py"]

# dumb-init runs as PID 1: it forwards SIGTERM/SIGINT/SIGUSR1 to the runner and reaps the
# orphans a supervised trainer leaves behind. `docker run IMAGE runner <subcommand> ...` runs
# any command under it.
ENTRYPOINT ["dumb-init", "--"]
CMD ["runner", "demo"]
