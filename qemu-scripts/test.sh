#!/usr/bin/env bash
# The README's test command: installs what the tests need (the QEMU 11.1 prefix), builds the
# workspace and runs every test tier (unit tests, qtest integration tests against QEMU).
# Idempotent; the cache lives in ${VGPU_CACHE:-$HOME/.cache/vgpu}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { printf '\n== [%s] %s\n' "$1" "$2"; }
command -v cargo >/dev/null || { echo "test.sh: cargo not found; install the Rust toolchain (rustup)" >&2; exit 1; }

step 1/3 "QEMU prefix"
qemu-scripts/setup-qemu.sh

step 2/3 "build (workspace, all targets)"
cargo build --workspace --all-targets --locked

step 3/3 "tests (unit + qtest integration)"
# QEMU is installed above, so a test that cannot start it must fail, not skip.
log=$(mktemp "${TMPDIR:-/tmp}/vgpu-test.XXXXXX")
trap 'rm -f "$log"' EXIT
status=0
VGPU_REQUIRE_QEMU=1 cargo test --workspace --locked 2>&1 | tee "$log" || status=$?
# One closing line over all test binaries (cargo prints one "test result" per binary).
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "\ntests: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
exit "$status"
