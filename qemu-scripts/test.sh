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
VGPU_REQUIRE_QEMU=1 cargo test --workspace --locked
