#!/usr/bin/env bash
# NvCuda on a GPU host that has no network or cargo: `build` (here) stages the mdev-backend
# unit-test binary and the compute_backend bench under target/cuda-h100; `run` (there, from a
# copy of the repository carrying that folder) runs the compute tests, whose conformance
# sequence and event-timed executor groups run on the real driver when it loads (each prints
# "skipped: ..." otherwise), then the bench on NvCuda.
#   qemu-scripts/nvcuda-check.sh build|run
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=target/cuda-h100
executable() {
    sed -n "s/.*\"executable\":\"\\([^\"]*$1[^\"]*\\)\".*/\\1/p" | tail -1
}
case "${1:-}" in
build)
    mkdir -p "$out"
    cp "$(cargo test -p mdev-backend --lib --no-run --message-format=json 2>/dev/null |
        executable mdev_backend)" "$out/mdev_backend_lib"
    cp "$(cargo bench -p mdev-backend --bench compute_backend --no-run --message-format=json \
        2>/dev/null | executable compute_backend)" "$out/compute_backend"
    ls -l "$out"
    ;;
run)
    "$out/mdev_backend_lib" compute:: --nocapture --test-threads=1
    VGPU_COMPUTE=nvcuda "$out/compute_backend" --bench
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
