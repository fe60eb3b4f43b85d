#!/usr/bin/env bash
# The README's test command: installs what the tests need (the QEMU 11.1 prefix, the Debian guest
# image, the CUDA corpus, the piglit disk), builds the workspace, runs every fuzz target briefly and runs every test tier (unit
# tests, qtest integration tests against QEMU, guest end-to-end tests booting the image under QEMU).
# Idempotent; the cache lives in ${VGPU_CACHE:-$HOME/.cache/vgpu}.
#
# --loaded: the same run with every core of the host kept busy beside the fuzz smoke run and
# the tests (stress-ng --cpu with one worker a core, from the build's end until the script
# ends, however it ends), to show that no test depends on having the machine to itself. The
# papers' experiments on guests check that the host gave their VMs the CPU they wanted; a run the
# load starved, or a comparison of VMs that waited for a CPU more than half the time, is reported
# INCONCLUSIVE there (VGPU_TEST_LOADED), not judged.
set -euo pipefail
usage() {
    echo "usage: $(basename "$0") [--loaded]" >&2
    exit 2
}
loaded=0
for arg in "$@"; do
    case $arg in
    --loaded) loaded=1 ;;
    *) usage ;;
    esac
done
STEPS=6
# Tools the tests drive besides QEMU: Chromium (the dashboard's browser test, headless),
# promtool from prometheus (the metrics check), virt-xml-validate from libvirt-clients with
# xmllint (libxml2-utils) and libvirt's schemas (libvirt0) for the libvirt recipe,
# systemd-analyze with man(1) from man-db (the service units' verify, which looks up their
# man: documentation, and security checks) and strace (the units' system call filters
# against what the daemon and the device process call); curl, xz and mkfs.ext4 for the piglit
# disk; zsh and fish, which run vgpuctl's completion scripts (bash is there).
EXTRA_DEBS=(chromium prometheus libvirt-clients libvirt0 libxml2-utils systemd man-db strace
    curl xz-utils e2fsprogs zsh fish)
# The loaded mode's CPU load.
((loaded)) && EXTRA_DEBS+=(stress-ng)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# Measured 2026-11-27: target/ 2.5 GiB after the tests, fuzz/target 0.9 GiB, the cache 1.5 GiB
# (QEMU prefix, nvcc wheels, guest image) plus about 1 GiB while the image is built.
need_disk 6 "the test run (build directories, cache, guest image)"
# One build, then tests: incremental compilation would only add its 2 GiB of state.
export CARGO_INCREMENTAL=0

step "CUDA corpus (nvcc from PyPI wheels, GCC nvptx offloading; tests/cuda)"
qemu-scripts/cuda-corpus.sh

step "guest image (Debian trixie with our libcuda.so.1 and the corpus, for the guest end-to-end tests) and the piglit disk"
qemu-scripts/build-guest-image.sh
qemu-scripts/build-piglit-disk.sh

step "build (workspace, all targets)"
cargo build --workspace --all-targets --locked

# The loaded mode's load, stopped when the script exits. Bounded in time too, in case the
# script is killed with SIGKILL and cannot stop it.
LOAD_TIMEOUT=6h
load_pid=
log=
cleanup() {
    if [[ -n $load_pid ]]; then
        kill "$load_pid" 2>/dev/null || true
        wait "$load_pid" 2>/dev/null || true
        echo "loaded mode: the CPU load (stress-ng, pid $load_pid) stopped"
    fi
    [[ -z $log ]] || rm -f "$log"
}
trap cleanup EXIT
load_note=
if ((loaded)); then
    cores=$(nproc)
    stress-ng --cpu "$cores" --timeout "$LOAD_TIMEOUT" --quiet &
    load_pid=$!
    load_note=" (loaded: stress-ng --cpu $cores beside them)"
    # The experiments on guests may then find the host starved their VMs of CPU (their
    # precondition): they say so instead of failing (tests/tests/experiments_vms.rs).
    export VGPU_TEST_LOADED=1
    echo "loaded mode: stress-ng --cpu $cores (pid $load_pid) keeps every core busy until the tests end"
fi

step "fuzz smoke run (every fuzz target for a few seconds; docs/FUZZING.md)$load_note"
qemu-scripts/fuzz.sh --smoke

step "tests (unit, qtest integration, guest end-to-end)$load_note"
# QEMU, virglrenderer and the guest image are installed above, so a test that cannot start them
# must fail, not skip.
log=$(mktemp "${TMPDIR:-/tmp}/vgpu-test.XXXXXX")
status=0
VGPU_REQUIRE_CUDA_CORPUS=1 VGPU_REQUIRE_QEMU=1 VGPU_REQUIRE_VIRGL=1 VGPU_REQUIRE_GUEST=1 VGPU_REQUIRE_PIGLIT=1 VGPU_REQUIRE_CGROUP=1 VGPU_GUEST_GL=1 cargo test --workspace --locked 2>&1 | tee "$log" || status=$?
# One closing line over all test binaries (cargo prints one "test result" per binary).
awk -v note="$load_note" '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "\ntests: %d passed, %d failed, %d skipped%s\n", p, f, i, note }' "$log"
exit "$status"
