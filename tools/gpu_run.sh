#!/usr/bin/env bash
# `make test-gpu` and the GPU bench records on a GPU host that has its own python3 (torch, pytest)
# and no package index: the device tool's H200, one call per stage or a few stages per call.
#
#   bash tools/gpu_wheels.sh                      # here, once: writes .whl/ (carry it)
#   WCACHE_COMMIT=<sha> bash tools/gpu_run.sh STAGE [STAGE...]   # there, in the repository root;
#                                     # writes to $OUT; the bench records carry WCACHE_COMMIT (a copied
#                                     # tree has no .git to read it from)
#
# Stages, each under its own time limit (seconds); a call runs up to 10 minutes, so give it stages
# whose typical times (measured on the H200 at 69f4ca9, ~) add up to less:
#   tier      (560)        the whole GPU tier in one run: every gpu-marked test and every page in GPU
#                          mode, side by side (tools/gpu_tier.sh, `make test-gpu`)  -> gpu-tier.log
#   records          llama-8b checkpoint (240), `wcache bench --repeat 3` with vmm_fd (260), then the
#                    same checkpoint in FP8 (-q fp8, 240) and its vmm_fd bench (260): the handoff records
#                    -> llama-8b-vmm_fd.json, llama-8b-fp8-vmm_fd.json and their .log
#   retry     (300)        the tier's run of only the tests TIER_K selects (pytest -k): what failed last time
#                                                    -> gpu-retry.log
#   smoke     (300)        the GPU tests and two pages (quickstart, memory) through the tier's workers:
#                          a quick check of the tier itself  -> gpu-smoke.log
#   nvml                   what the driver charges a daemon and a zero_copy engine (probe) -> nvml.log
#   tests     (420, ~280)  the gpu-marked tests, the guide's pages left out  -> gpu-tests.log
#   pages1    (560, ~250)  the first half of the guide's pages in GPU mode   -> guide-gpu-mode-1.log
#   pages2    (560, ~250)  the second half (the 20 pages took 508 s in all)  -> guide-gpu-mode-2.log
#   bench8b          llama-8b checkpoint (240: ~85 s), then `wcache bench --repeat 3` with vmm_fd and
#                    with cuda_ipc (260 each: ~150 s) -> llama-8b-{vmm_fd,cuda_ipc}.json and .log
#   vmm, ipc         the same, one transport each (when bench8b would not fit one call)
#   bench10k         tensors-10k checkpoint (240), then `wcache bench` with vmm_fd (240)
#                                                    -> tensors-10k-vmm_fd.json and .log
#   respawn          llama-8b checkpoint (240), then `wcache bench --respawn --repeat 10` (10 kills) with vmm_fd (420)
#                                                    -> llama-8b-respawn.json and .log
#   batching         the continuous-batching and respawn GPU tests alone (240)  -> gpu-batching.log
#   stream           llama-8b checkpoint (240), then 64 streaming clients against one, bf16
#                    (python -m wcache.bench.streaming --vs-one, then the bare step: the model read
#                    again and two graphs; 420) -> llama-8b-streaming.json and .log
#   seed8b           llama-8b checkpoint (240), then `wcache bench --seed --seed-replicas 0` (420): a replica
#                    daemon on the same GPU seeded over TCP from a llama-8b source, its READY time beside a
#                    disk start, and the raw TCP copy of the arena's bytes  -> llama-8b-seed.json and .log
#   seedsmall        the same with the small preset (about 500 MB): a minute, where llama-8b's is several
# tests + pages1 + pages2 together are `make test-gpu` (WCACHE_RUN_GPU_BLOCKS=1 pytest tests -m gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/.work/gpu-out}
mkdir -p "$OUT"
[ $# -gt 0 ] || { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 2; }

# The carried wheels (tools/gpu_wheels.sh), once per machine and again whenever the set changes (a warm
# machine keeps /tmp/site from an earlier call); the host's own packages stay.
if [ -d .whl ] && [ "$(ls .whl)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    ls .whl > /tmp/site/.wheels
fi
# `wcache` (and `python`, which some pages type) for every process the pages start.
mkdir -p /tmp/gpu-bin
printf '#!/bin/sh\nexec python3 -m wcache.cli "$@"\n' > /tmp/gpu-bin/wcache
printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/gpu-bin/python
chmod +x /tmp/gpu-bin/wcache /tmp/gpu-bin/python
export PATH=/tmp/gpu-bin:/tmp/site/bin:$PATH
export PYTHONPATH=/tmp/site:$ROOT/reference_impl:$ROOT/tests:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export WCACHE_RUN_GPU_BLOCKS=1 PYTHONUNBUFFERED=1

# Every page of the guide, in pytest's order (sorted), split in two halves.
mapfile -t PAGES < <(ls docs/*.md | sort)
HALF=$(( (${#PAGES[@]} + 1) / 2 ))
page_ids() { for p in "$@"; do echo "tests/docs/test_blocks.py::test_page_on_gpu[$p]"; done; }

stage() {  # NAME LIMIT LOG COMMAND...: one stage under its limit, its output in $OUT/LOG
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$SECONDS
  timeout -k 20 "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  echo "stage $name: exit $rc in $((SECONDS - t0)) s (limit $limit s); last lines of $log:"
  tail -n 3 "$OUT/$log"
  return $rc
}

bench() {  # MODEL_DIR NAME TRANSPORT LIMIT
  stage "bench $2 $3" "$4" "$2-$3.log" wcache bench --model "$1" --device cuda --transport "$3" --repeat 3 \
    --output "$OUT/$2-$3.json"
}

checkpoint() {  # DIR PRESET: written once per machine (a warm machine keeps /tmp)
  [ -f "$1/config.json" ] || stage "checkpoint $2" 240 "checkpoint-$2.log" wcache make-checkpoint "$1" --preset "$2"
}

rc=0
for s in "$@"; do
  case $s in
    tier)   stage tier "${TIER_LIMIT:-560}" gpu-tier.log bash tools/gpu_tier.sh || rc=1 ;;
    records)
      checkpoint /tmp/llama-8b llama-8b || rc=1
      bench /tmp/llama-8b llama-8b vmm_fd 260 || rc=1
      [ -f /tmp/llama-8b-fp8/config.json ] || stage "checkpoint llama-8b fp8" 240 checkpoint-llama-8b-fp8.log \
        wcache make-checkpoint /tmp/llama-8b-fp8 --preset llama-8b -q fp8 || rc=1
      bench /tmp/llama-8b-fp8 llama-8b-fp8 vmm_fd 260 || rc=1 ;;
    retry)  stage retry 300 gpu-retry.log bash tools/gpu_tier.sh -k "${TIER_K:?TIER_K: the tests to run again}" || rc=1 ;;
    smoke)  stage smoke 300 gpu-smoke.log bash tools/gpu_tier.sh -k "not test_page_on_gpu or quickstart or memory" || rc=1 ;;
    nvml)   stage nvml 90 nvml.log python3 tools/probes/nvml_probe.py || rc=1 ;;
    tests)  stage tests 420 gpu-tests.log python3 -m pytest tests -m gpu -k "not test_page_on_gpu" -p no:cacheprovider || rc=1 ;;
    pages1) stage pages1 560 guide-gpu-mode-1.log python3 -m pytest -p no:cacheprovider -v \
              $(page_ids "${PAGES[@]:0:HALF}") || rc=1 ;;
    pages2) stage pages2 560 guide-gpu-mode-2.log python3 -m pytest -p no:cacheprovider -v \
              $(page_ids "${PAGES[@]:HALF}") || rc=1 ;;
    bench8b)
      checkpoint /tmp/llama-8b llama-8b || rc=1
      bench /tmp/llama-8b llama-8b vmm_fd 260 || rc=1
      bench /tmp/llama-8b llama-8b cuda_ipc 260 || rc=1 ;;
    vmm|ipc)
      checkpoint /tmp/llama-8b llama-8b || rc=1
      bench /tmp/llama-8b llama-8b "$([ "$s" = vmm ] && echo vmm_fd || echo cuda_ipc)" 260 || rc=1 ;;
    bench10k)
      checkpoint /tmp/t10k tensors-10k || rc=1
      bench /tmp/t10k tensors-10k vmm_fd 240 || rc=1 ;;
    respawn)
      checkpoint /tmp/llama-8b llama-8b || rc=1
      stage "bench llama-8b respawn" 420 llama-8b-respawn.log wcache bench --respawn --model /tmp/llama-8b --device cuda \
        --transport vmm_fd --repeat 10 --json --output "$OUT/llama-8b-respawn.json" || rc=1 ;;
    batching) stage batching 240 gpu-batching.log python3 -m pytest -p no:cacheprovider -v \
                tests/gpu/test_batching_gpu.py tests/gpu/test_respawn_gpu.py || rc=1 ;;
    stream)
      checkpoint /tmp/llama-8b llama-8b || rc=1
      stage "stream llama-8b" 420 llama-8b-streaming.log python3 -m wcache.bench.streaming /tmp/llama-8b --clients 64 \
        --max-tokens 128 --vs-one --device cuda --dtype bfloat16 --output "$OUT/llama-8b-streaming.json" || rc=1 ;;
    seed8b|seedsmall)
      preset=$([ "$s" = seed8b ] && echo llama-8b || echo small)
      checkpoint "/tmp/$preset" "$preset" || rc=1
      stage "bench $preset seed" 420 "$preset-seed.log" wcache bench --seed --seed-replicas 0 --repeat 1 \
        --model "/tmp/$preset" --device cuda --output "$OUT/$preset-seed.json" || rc=1 ;;
    *) echo "unknown stage $s"; rc=2 ;;
  esac
done
exit $rc
