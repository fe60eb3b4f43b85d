#!/usr/bin/env bash
# The differential check of the compute backends: the CUDA corpus (qemu-scripts/cuda-corpus.sh)
# runs through the same trait-level tests (mdev-backend/tests/cuda_corpus.rs) on the PTX
# executor and on the real driver (NvCuda, needs libcuda.so.1 and a GPU), each result checked
# against the same host computation, each test in a process of its own; prints each backend's
# outcome and time (logs in /tmp/cuda-differential-BACKEND.log). CI never runs this.
#   qemu-scripts/cuda-differential.sh [TEST-BINARY]
# TEST-BINARY: a prebuilt cuda_corpus test binary (for a machine without cargo).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ $# -ge 1 ]]; then
    bin=$1
else
    qemu-scripts/cuda-corpus.sh
    bin=$(cargo test -p mdev-backend --test cuda_corpus --release --no-run --message-format=json 2>/dev/null |
        sed -n 's/.*"executable":"\([^"]*cuda_corpus[^"]*\)".*/\1/p' | tail -1)
fi
# Each test in its own process: on the real driver a fault breaks CUDA for the whole process.
mapfile -t tests < <("$bin" --list --format terse | sed -n 's/: test$//p')
status=0
for backend in cpu nvcuda; do
    log=/tmp/cuda-differential-$backend.log
    : >"$log"
    start=$(date +%s%N)
    passed=0 failed=()
    for t in "${tests[@]}"; do
        if VGPU_COMPUTE=$backend VGPU_REQUIRE_CUDA_CORPUS=1 "$bin" --exact "$t" --nocapture >>"$log" 2>&1; then
            passed=$((passed + 1))
        else
            failed+=("$t")
        fi
    done
    ms=$((($(date +%s%N) - start) / 1000000))
    printf '%-7s %s  %d.%03d s  %d passed, %d failed %s\n' "$backend" \
        "$([[ ${#failed[@]} == 0 ]] && echo pass || echo FAIL)" $((ms / 1000)) $((ms % 1000)) \
        "$passed" "${#failed[@]}" "${failed[*]}"
    ((${#failed[@]} == 0)) || status=1
done
exit "$status"
