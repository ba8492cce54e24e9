#!/usr/bin/env bash
# The weight cache daemon and the engine in two containers that share nothing but two volumes:
# no --ipc=host, no --pid=host, no shared /dev/shm. Each container keeps its own PID and IPC
# namespaces. On a GPU this needs the vmm_fd transport, which hands the weights over as a file
# descriptor on the Unix socket and needs only the NVIDIA driver in both containers
# (docs/gpu-transports.md). docs/docker.md gives the reason for the other flags.
# Settings, from the environment:
#   MODEL_DIR    the model directory on the host (config.json and *.safetensors); required
#   IMAGE        the image both containers run; default wcache:0.1.0
#   PORT         the engine's HTTP port; default 8000
#   HEALTH_PORT  the daemon's /health port; default 8001
#   NAME         prefix of the container and volume names; default wcache
set -euo pipefail
: "${MODEL_DIR:?set MODEL_DIR to the model directory on the host}"
IMAGE=${IMAGE:-wcache:0.1.0} PORT=${PORT:-8000} HEALTH_PORT=${HEALTH_PORT:-8001} NAME=${NAME:-wcache}

# What the two containers share: the socket directory and the cache root (autotune results).
docker volume create "$NAME-sockets"
docker volume create "$NAME-cache"

# The daemon: long-lived, in its own PID and IPC namespaces. --weight-cache-transport vmm_fd:
# the GPU arena is a CUDA VMM allocation exported as a file descriptor (CPU: always a memfd).
# Restarted always, like the engine (docs/docker.md); health port on loopback only.
docker run -d --name "$NAME-daemon" --restart always \
    --gpus all --network host \
    --cap-drop ALL --security-opt no-new-privileges --memory 4g \
    -v "$NAME-sockets:/run/wcache" -v "$NAME-cache:/var/cache/wcache" -v "$MODEL_DIR:/model:ro" \
    -e WCACHE_HEALTH_URL="http://127.0.0.1:$HEALTH_PORT/health" \
    --entrypoint wcache "$IMAGE" \
    preload --model /model --weight-cache-socket-dir /run/wcache/sockets \
    --weight-cache-health-port "$HEALTH_PORT" --weight-cache-health-host 127.0.0.1 \
    --weight-cache-transport vmm_fd

# Start the engine only once the daemon serves.
until curl -fs "http://127.0.0.1:$HEALTH_PORT/health"; do
    if [ "$(docker inspect -f '{{.State.Running}}' "$NAME-daemon")" != true ]; then
        docker logs "$NAME-daemon"
        exit 1
    fi
    sleep 2
done

# The engine: same image, same user, same GPUs, the same two volumes, and its own PID and IPC
# namespaces. "transport": "vmm_fd": on a GPU it refuses a daemon that serves legacy CUDA IPC,
# whose handles are not made to cross namespaces (docs/gpu-transports.md). Fallback off, the API on
# loopback and the drain's stop timeout as in examples/docker-run.sh.
docker run -d --name "$NAME-engine" --restart always --stop-timeout 60 \
    --gpus all --network host \
    --cap-drop ALL --security-opt no-new-privileges --memory 4g \
    -v "$NAME-sockets:/run/wcache" -v "$NAME-cache:/var/cache/wcache" -v "$MODEL_DIR:/model:ro" \
    -e WCACHE_HEALTH_URL="http://127.0.0.1:$PORT/health" \
    "$IMAGE" /model --host 127.0.0.1 --port "$PORT" --load-format ipc_cache \
    --model-loader-extra-config '{"socket_dir": "/run/wcache/sockets", "transport": "vmm_fd", "fallback": false}'
