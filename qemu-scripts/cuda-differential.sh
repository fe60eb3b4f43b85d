#!/usr/bin/env bash
# The differential check of the compute backends: the CUDA corpus (qemu-scripts/cuda-corpus.sh)
# runs through the same trait-level tests (mdev-backend/tests/cuda_corpus.rs) on the PTX
# executor and on the real driver (NvCuda, needs libcuda.so.1 and a GPU), each result checked
# against the same host computation; prints each run's outcome and time. CI never runs this.
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
status=0
for backend in cpu nvcuda; do
    start=$(date +%s.%N)
    rc=0
    VGPU_COMPUTE=$backend VGPU_REQUIRE_CUDA_CORPUS=1 "$bin" --test-threads=1 >"/tmp/cuda-differential-$backend.log" 2>&1 || rc=$?
    end=$(date +%s.%N)
    printf '%-7s %s  %6.2f s  %s\n' "$backend" "$([[ $rc == 0 ]] && echo pass || echo FAIL)" \
        "$(echo "$end - $start" | bc)" "$(grep -m1 '^test result' "/tmp/cuda-differential-$backend.log" || echo 'no result')"
    ((rc == 0)) || status=1
done
exit "$status"
