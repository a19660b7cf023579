# spot-runner image. The base only needs a `python3` (3.11+) on PATH that imports torch: a
# PyTorch CUDA runtime image in production (torch in a conda env), a Debian/Ubuntu base with
# torch in the system interpreter (PEP 668: plain `pip install` refused), or the local Debian
# bases of the tests (scripts/build-base-image.sh). Build with BuildKit:
# DOCKER_BUILDKIT=1 docker build .
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

# --- builder: turn the source tree into a wheel; build tools stay in this stage -------------
FROM ${BASE_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# README* so a checkout without the README still builds (pyproject names it as readme).
COPY pyproject.toml README* ./
COPY runner ./runner
COPY docker/make-venv.sh /out/make-venv.sh
# The same venv as the final stage: a base may have no pip outside ensurepip, or refuse it.
RUN --mount=type=cache,target=/root/.cache/pip \
    sh /out/make-venv.sh /opt/build-venv \
    && /opt/build-venv/bin/python -m pip wheel --no-deps --wheel-dir /out/wheels .

# --- final: the runtime only ---------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG DUMB_INIT_VERSION=1.2.5.post1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RUNNER_RUN_DIR=/data/run \
    RUNNER_METRICS_PORT=9400

# The project and dumb-init go into a venv that sees the base's packages
# (docker/make-venv.sh): the base's environment is never modified, which is what PEP 668
# bases require, and pip treats the base's torch as installed; the constraint pins it, so pip
# fails rather than download another torch. dumb-init comes from PyPI as a static binary so
# one recipe works on Debian, Ubuntu and conda-based images alike. The pip cache is a BuildKit
# cache mount and the builder's output a bind mount (on /mnt, which exists in every base):
# neither lands in a layer.
RUN --mount=type=bind,from=builder,source=/out,target=/mnt \
    --mount=type=cache,target=/root/.cache/pip \
    sh /mnt/make-venv.sh /opt/spot-runner \
    && /opt/spot-runner/bin/python -m pip install -c /opt/spot-runner/base-constraints.txt \
        /mnt/wheels/*.whl "dumb-init==${DUMB_INIT_VERSION}" \
    && /opt/spot-runner/bin/python -c "import runner, torch" \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin runner \
    && mkdir -p /data/run \
    && chown -R 10001:10001 /data
# The venv first: `python3`, `runner`, `dumb-init` and `pip` (for images built FROM this one)
# are the venv's.
ENV PATH=/opt/spot-runner/bin:$PATH

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
