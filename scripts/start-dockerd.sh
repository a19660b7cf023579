#!/usr/bin/env bash
# Start the Docker engine if it is not answering yet; safe to run any number of times.
# Needs root (dockerd). Log: $DOCKERD_LOG (default /var/log/dockerd.log).
set -euo pipefail

docker_bin="${DOCKER:-/usr/bin/docker}"
log="${DOCKERD_LOG:-/var/log/dockerd.log}"
wait_s="${DOCKERD_WAIT_SECONDS:-30}"

if "$docker_bin" info >/dev/null 2>&1; then
    echo "docker engine already running"
    exit 0
fi
command -v dockerd >/dev/null || { echo "error: dockerd not found (apt-get install -y docker.io)" >&2; exit 2; }

# A stale pid file from a killed engine makes dockerd refuse to start.
pidfile=/var/run/docker.pid
if [[ -f $pidfile ]] && ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    rm -f "$pidfile"
fi
# setsid: the engine outlives the shell (and the test session) that started it.
setsid dockerd >>"$log" 2>&1 </dev/null &

for _ in $(seq "$((wait_s * 4))"); do
    if "$docker_bin" info >/dev/null 2>&1; then
        echo "docker engine started (log: $log)"
        exit 0
    fi
    sleep 0.25
done
echo "error: docker engine did not answer within ${wait_s}s; last lines of $log:" >&2
tail -n 20 "$log" >&2
exit 1
