#!/usr/bin/env bash
# Build the wcache image from examples/Dockerfile, the file users build, FROM the locally built base
# (build-base.sh). A build cannot reach a package index here, so the wheels the image needs (torch
# CPU, the project's dependencies, its build backend) are fetched on the host into
# build/docker-wheels and passed in the build context (WHEELS=...); the RUN steps get no network.
#   IMAGE       tag to build (default wcache:dockertest)
#   BASE_IMAGE  default wcache-base:bookworm
#   PYTHON      host interpreter whose pip fetches the wheels (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${IMAGE:-wcache:dockertest}
BASE_IMAGE=${BASE_IMAGE:-wcache-base:bookworm}
PYTHON=${PYTHON:-.venv/bin/python}
WHEELS=build/docker-wheels
# The image's Python is bookworm's 3.11; the torch pin is the Makefile's CPU build.
TORCH_PIN=$(sed -n 's/^TORCH_PIN := //p' Makefile)
mapfile -t REQS < <("$PYTHON" - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
for r in p["build-system"]["requires"] + p["project"]["dependencies"]:
    print(r)
PY
)
REQS+=("${TORCH_PIN:-torch}")
stamp=$(printf '%s\n' "${REQS[@]}" | sha256sum | cut -c1-16)
if [ "$(cat "$WHEELS/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS"
    echo "fetching wheels: ${REQS[*]}"
    "$PYTHON" -m pip download -q --disable-pip-version-check --only-binary :all: \
        --python-version 3.11 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "${REQS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    echo "$stamp" >"$WHEELS/.stamp"
fi
# The classic builder: it uses the local base image as it is, where BuildKit would ask a registry.
DOCKER_BUILDKIT=0 docker build --network none -f examples/Dockerfile \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg WHEELS="$WHEELS" -t "$IMAGE" .
