#!/usr/bin/env bash
# Build a local stand-in for a PyTorch runtime image, for machines with no registry access:
# Debian bookworm (debootstrap, minbase) with python3 3.11, a venv on PATH holding the CPU
# torch wheel and numpy, and the host's extra CA certificates (HTTPS is intercepted here).
# The project's Dockerfile only needs `python3` on PATH that can import torch, which is what
# pytorch/pytorch:*-runtime images give in production.
#
# Usage: scripts/build-base-image.sh [--force] [TAG]
# Cached by tag: when TAG already exists in the engine, nothing is rebuilt unless --force.
set -euo pipefail

force=0
if [[ "${1:-}" == "--force" ]]; then
    force=1
    shift
fi
tag="${1:-spot-runner/test-base:bookworm-torch2.13.0-cpu}"
torch_version="${TORCH_VERSION:-2.13.0}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
docker_bin="${DOCKER:-docker}"

if [[ $force -eq 0 ]] && "$docker_bin" image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag already present"
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
