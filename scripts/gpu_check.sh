#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool runs it from the repository root; $OUT comes back):
# the 7B benchmark beside transformers, then the GPU tests. Each step has its own time limit so the
# whole stays under the 600 s a call may take; omni-bench prints a progress line per phase on stderr,
# so a step cut short still shows how far it got.
#   usage: bash scripts/gpu_check.sh [BENCH_SECONDS] [TEST_SECONDS]
set -u
out=${OUT:-/tmp/omni-gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout "${1:-300}" python3 -m omni_cli.bench --preset qwen2.5-omni-7b --runs 2 --compare-hf --json \
    > "$out/bench.json" 2> "$out/bench.err"
echo "bench rc=$?"; grep '^\[omni-bench' "$out/bench.err"
timeout "${2:-270}" python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider 2>&1 | grep -v DEBUG > "$out/test_gpu.log"
tail -3 "$out/test_gpu.log"; grep -E "codes: ref|text eq|talker step|^E " "$out/test_gpu.log" | head -20
