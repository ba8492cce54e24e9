#!/usr/bin/env bash
# Start dockerd in the background unless a Docker engine already answers (needs root).
# No bridge and no iptables rules: every container of the examples runs with --network host, so all
# of their traffic stays on this machine's loopback. Prints the PID of the dockerd it started, and
# nothing when one was already running.
set -euo pipefail
LOG=${DOCKERD_LOG:-/var/log/wcache-dockerd.log}
if docker info >/dev/null 2>&1; then
    exit 0
fi
setsid dockerd --bridge=none --iptables=false >>"$LOG" 2>&1 </dev/null &
pid=$!
for _ in $(seq 1 120); do
    if docker info >/dev/null 2>&1; then
        echo "$pid"
        exit 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "dockerd exited during startup; the end of $LOG:" >&2
        tail -n 20 "$LOG" >&2
        exit 1
    fi
    sleep 0.5
done
echo "dockerd did not answer within 60 s; the end of $LOG:" >&2
tail -n 20 "$LOG" >&2
kill "$pid" 2>/dev/null || true
exit 1
