#!/usr/bin/env bash
# Wheels for a GPU host that cannot reach a package index (tools/gpu_run.sh installs them there):
# the dev extra's docs and validation libraries, for CPython 3.12 on x86-64 Linux, with every
# dependency except those the host's Python already has. Runs here; writes .whl/ (git-ignored).
#
#   bash tools/gpu_wheels.sh            # what `make test-gpu` needs; then carry .whl to the GPU host
#   bash tools/gpu_wheels.sh --site     # also mkdocs and mkdocs-material, to build the site there
#
# The device tool carries at most 64 MiB with the working tree: the default set is about 36 MiB;
# --site adds about 25 (mkdocs-material and its babel), too much to carry beside the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# What the guide's pages need on a GPU host beyond its python3 (torch, pytest, pyyaml...): the
# runner's parser (markdown-it-py, whose image version may predate 3, and its plugins), Python blocks
# (pytest-examples), the YAML/JSON validators, and the official OpenAI client (test_openai_client.py). No gpu-marked test builds the site.
# The OpenAI client at the version this checkout's tests ran with here (newer ones may differ).
OPENAI=$("$PY" -c 'import importlib.metadata as m; print(m.version("openai"))')
# prometheus-client is a runtime dependency of wcache itself (GET /metrics), absent from the host's image;
# so is msgspec (the frames between `wcache serve`'s front and its engine core, engine/core/core_messages.py).
WANTED=(pymdown-extensions markdown-it-py mdit-py-plugins pytest-examples kubernetes-validate
        check-jsonschema jsonschema "openai==$OPENAI" prometheus-client msgspec)
if [ "${1:-}" = --site ]; then
  WANTED+=(mkdocs mkdocs-material)
fi
# Already in the GPU host's image (its python3 3.12; /work/.library/device/KINDS.md lists them).
# Carried anyway where the image's version could be too old for the dev extra: markdown-it-py.
ON_HOST=(attrs certifi charset-normalizer click colorama idna jinja2 markdown markupsafe mdurl
         packaging pluggy iniconfig pygments pytest pyyaml requests rich typing-extensions urllib3
         filelock six python-dateutil pathspec)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --disable-pip-version-check --dest "$tmp" --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any "${WANTED[@]}"
rm -rf .whl && mkdir -p .whl
for w in "$tmp"/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--')
  skip=
  for h in "${ON_HOST[@]}"; do [ "$name" = "$h" ] && skip=1; done
  [ -n "$skip" ] || cp "$w" .whl/
done
ls .whl | sed 's/-py.*//; s/-cp.*//' | tr '\n' ' '
echo
du -sh .whl
