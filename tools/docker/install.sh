#!/usr/bin/env bash
# Install what the docker tier needs, from Debian's packages, when it is missing (needs root):
#   docker.io       the engine (dockerd, containerd, runc) and the docker CLI
#   docker-compose  Compose 1.29, Debian's implementation of the Compose Specification (the
#                   `docker compose` v2 plugin is not packaged for bookworm); it honours
#                   depends_on.condition: service_healthy, healthcheck.start_period and ipc/pid
#                   "service:" modes, which is what examples/compose*.yaml use
#   debootstrap     builds the base image's root filesystem (no image registry is reachable)
#   curl            the docker-run example waits for the daemon's /health with it
set -euo pipefail
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v curl >/dev/null || need+=(curl)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
echo "installing: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q "${need[@]}"
