#!/usr/bin/env bash
# Build local stand-ins for PyTorch runtime images, for machines with no registry access.
#
# venv (default): Debian bookworm (debootstrap, minbase) with python3 3.11, a venv on PATH
#   holding the CPU torch wheel and numpy, and the host's extra CA certificates (HTTPS is
#   intercepted here) -- like pytorch/pytorch images, whose torch is in a conda env on PATH.
# --pep668: the same rootfs with torch, numpy and pip moved into the *system* interpreter
#   (/usr/local/lib/python3.11/dist-packages, where `pip install --break-system-packages`
#   puts them), the venv gone, /usr/lib/python3.11/EXTERNALLY-MANAGED left in place and
#   python3-venv (ensurepip) removed -- like a Debian 12 / Ubuntu 24.04 base with torch
#   installed system-wide: a plain `pip install` there fails with externally-managed-environment.
#   Built FROM the venv base (built first when missing): no second debootstrap.
#
# The project's Dockerfile only needs `python3` on PATH (3.11+) that can import torch.
#
# Usage: scripts/build-base-image.sh [--force] [--pep668] [TAG]
#   VENV_BASE_TAG: the venv base a --pep668 build starts from.
# Cached by tag: when TAG already exists in the engine, nothing is rebuilt unless --force
# (--force --pep668 rebuilds only the PEP 668 layer, not the venv base under it).
set -euo pipefail

force=0
variant=venv
while [[ "${1:-}" == --* ]]; do
    case "$1" in
        --force) force=1 ;;
        --pep668) variant=pep668 ;;
        *) echo "error: unknown option $1 (usage: $0 [--force] [--pep668] [TAG])" >&2; exit 2 ;;
    esac
    shift
done
torch_version="${TORCH_VERSION:-2.13.0}"
venv_tag="${VENV_BASE_TAG:-spot-runner/test-base:bookworm-torch${torch_version}-cpu}"
if [[ $variant == pep668 ]]; then
    tag="${1:-${venv_tag}-pep668}"
else
    tag="${1:-$venv_tag}"
fi
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
docker_bin="${DOCKER:-docker}"

if [[ $force -eq 0 ]] && "$docker_bin" image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag already present"
    exit 0
fi

if [[ $variant == pep668 ]]; then
    # The venv base is cached by its own tag; --force applies to the PEP 668 layer only.
    "$(dirname "$0")/build-base-image.sh" "$venv_tag"
    start=$(date +%s)
    no_cache=()
    [[ $force -eq 1 ]] && no_cache=(--no-cache)
    # A real base would have run `pip install --break-system-packages torch`; moving the
    # venv's site-packages puts the same files in the same place without a download. Console
    # scripts get the system interpreter's shebang. PATH drops /opt/py/bin, so `python3` is
    # /usr/bin/python3. The build checks that a plain `pip install` is refused.
    DOCKER_BUILDKIT=1 "$docker_bin" build --quiet --force-rm "${no_cache[@]}" --build-arg "BASE=$venv_tag" \
        -t "$tag" - >/dev/null <<'DOCKERFILE'
ARG BASE
FROM ${BASE}
RUN set -eu; \
    site=/usr/local/lib/python3.11/dist-packages; \
    mkdir -p "$site"; \
    mv /opt/py/lib/python3.11/site-packages/* "$site/"; \
    for script in /opt/py/bin/*; do \
        name="${script##*/}"; \
        case "$name" in python*|activate*|Activate*) continue ;; esac; \
        sed '1s|^#!.*|#!/usr/bin/python3|' "$script" > "/usr/local/bin/$name"; \
        chmod 755 "/usr/local/bin/$name"; \
    done; \
    rm -rf /opt/py; \
    dpkg --purge python3-venv python3.11-venv >/dev/null; \
    test -f /usr/lib/python3.11/EXTERNALLY-MANAGED; \
    PATH=/usr/local/bin:/usr/bin:/bin python3 -c "import torch, numpy, pip"; \
    PATH=/usr/local/bin:/usr/bin:/bin python3 -m pip install --no-index six 2>&1 \
        | grep -q externally-managed-environment
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
DOCKERFILE
    echo "built $tag in $(( $(date +%s) - start )) s"
    exit 0
fi
for tool in debootstrap "$docker_bin" python3; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found (apt-get install -y debootstrap docker.io)" >&2; exit 2; }
done
if [[ $(id -u) -ne 0 ]]; then
    echo "error: debootstrap and chroot need root" >&2
    exit 2
fi

work="$(mktemp -d /var/tmp/spot-runner-base.XXXXXX)"
rootfs="$work/rootfs"
cleanup() {
    # a failed chroot step can leave /proc mounted inside the rootfs
    umount "$rootfs/proc" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

start=$(date +%s)
echo "debootstrap bookworm into $rootfs"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

# Trust the host's extra CAs so pip inside builds can reach the package index.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
fi
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot "$rootfs" update-ca-certificates >/dev/null

# The CPU torch wheel and its pure-Python dependencies come from the host's pip (local wheel
# cache first); never a CUDA build.
mkdir -p "$rootfs/tmp/wheels"
python3 -m pip download --quiet --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$rootfs/tmp/wheels" "torch==${torch_version}" numpy
if ls "$rootfs"/tmp/wheels/nvidia_* >/dev/null 2>&1; then
    echo "error: pip picked a CUDA torch build; the CPU wheel torch==${torch_version} must be in the local wheel cache" >&2
    exit 1
fi

# A clean environment: the host's PIP_* settings name paths that do not exist in the rootfs.
in_root() { env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 chroot "$rootfs" "$@"; }
mount -t proc proc "$rootfs/proc"
in_root python3 -m venv /opt/py
in_root /opt/py/bin/pip install --quiet --no-cache-dir --no-index \
    --find-links /tmp/wheels "torch==${torch_version}" numpy
in_root /opt/py/bin/python -c "import torch, numpy; print('torch', torch.__version__)"
umount "$rootfs/proc"

rm -rf "$rootfs/tmp/wheels" "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar --numeric-owner -C "$rootfs" -cf "$work/base.tar" .
"$docker_bin" import \
    --change 'ENV PATH=/opt/py/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$work/base.tar" "$tag" >/dev/null
echo "built $tag in $(( $(date +%s) - start )) s"
