#!/usr/bin/env bash
# The weight cache daemon and the engine in two containers of one image (examples/Dockerfile).
# docs/docker.md gives the reason for every flag. Settings, from the environment:
#   MODEL_DIR    the model directory on the host (config.json and *.safetensors); required
#   IMAGE        the image both containers run; default wcache:0.1.0
#   PORT         the engine's HTTP port; default 8000
#   HEALTH_PORT  the daemon's /health port; default 8001
#   NAME         prefix of the container and volume names; default wcache
set -euo pipefail
: "${MODEL_DIR:?set MODEL_DIR to the model directory on the host}"
IMAGE=${IMAGE:-wcache:0.1.0} PORT=${PORT:-8000} HEALTH_PORT=${HEALTH_PORT:-8001} NAME=${NAME:-wcache}

# Two named volumes, mounted in both containers: the socket directory, and the cache root
# (autotune results and checkpoint hashes, WCACHE_CACHE_ROOT=/var/cache/wcache in the image).
docker volume create "$NAME-sockets"
docker volume create "$NAME-cache"

# The daemon: long-lived. It loads the weights once and serves them on a socket in a subdirectory
# of the socket volume, which it creates itself (mode 0700, owned by its user).
# --restart always, like the engine: after a crash or a reboot the daemon comes back too, and the
# engine (fallback off, below) waits for it instead of loading a copy of its own. Its health port
# listens on loopback only. The image's user (uid 10001), no capabilities, no setuid gains.
docker run -d --name "$NAME-daemon" --restart always \
    --gpus all --ipc=host --pid=host --network host \
    --cap-drop ALL --security-opt no-new-privileges --memory 4g \
    -v "$NAME-sockets:/run/wcache" -v "$NAME-cache:/var/cache/wcache" -v "$MODEL_DIR:/model:ro" \
    -e WCACHE_HEALTH_URL="http://127.0.0.1:$HEALTH_PORT/health" \
    --entrypoint wcache "$IMAGE" \
    preload --model /model --weight-cache-socket-dir /run/wcache/sockets \
    --weight-cache-health-port "$HEALTH_PORT" --weight-cache-health-host 127.0.0.1

# Start the engine only once the daemon serves: an engine that starts earlier loads from disk
# and keeps a second copy of the weights next to the daemon's.
until curl -fs "http://127.0.0.1:$HEALTH_PORT/health"; do
    if [ "$(docker inspect -f '{{.State.Running}}' "$NAME-daemon")" != true ]; then
        docker logs "$NAME-daemon"
        exit 1
    fi
    sleep 2
done

# The engine: same image, same user, same GPUs, same volumes. Docker restarts it whenever it
# exits, and every new engine process maps the daemon's weights instead of reading the disk.
# "fallback": false: an engine that starts while the daemon is away (a reboot restarts both at
# once) waits for it rather than loading a second copy from disk. --host 127.0.0.1: with the host's
# network the API would otherwise listen on every address of the host (docs/docker.md says how to
# expose it). --stop-timeout 60: time for the engine to drain its requests when it is stopped.
docker run -d --name "$NAME-engine" --restart always --stop-timeout 60 \
    --gpus all --ipc=host --pid=host --network host \
    --cap-drop ALL --security-opt no-new-privileges --memory 4g \
    -v "$NAME-sockets:/run/wcache" -v "$NAME-cache:/var/cache/wcache" -v "$MODEL_DIR:/model:ro" \
    -e WCACHE_HEALTH_URL="http://127.0.0.1:$PORT/health" \
    "$IMAGE" /model --host 127.0.0.1 --port "$PORT" --load-format ipc_cache \
    --model-loader-extra-config '{"socket_dir": "/run/wcache/sockets", "fallback": false}'
