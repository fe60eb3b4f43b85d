#!/usr/bin/env bash
# The README's main job, on the embedded defaults (no GPU, no KVM needed): installs the QEMU
# prefix, builds, starts `vgpu-server`, lets a QEMU (qtest, no guest OS) enumerate the vGPU and
# fetch its display info through the control queue, then runs the doorbell benchmark.
set -euo pipefail
STEPS=4
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

step "build (release)"
cargo build --release --locked -p vgpu-server -p vgpu-tests --bins

step "vgpu-server + a QEMU client"
run=$(mktemp -d "${TMPDIR:-/tmp}/vgpu-demo.XXXXXX")
server_pid=
cleanup() {
    [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$run"
}
trap cleanup EXIT
target/release/vgpu-server --socket "$run/vgpu.sock" --exit-on-disconnect --log-level info \
    2> "$run/server.log" &
server_pid=$!
for _ in $(seq 100); do [[ -S $run/vgpu.sock ]] && break; sleep 0.05; done
target/release/vgpu-probe --socket "$run/vgpu.sock"
wait "$server_pid"
server_pid=
echo "server log (last lines):"
tail -n 4 "$run/server.log" | sed 's/^/  /'

step "doorbell benchmark (quick)"
cargo bench --locked -p vgpu-tests --bench doorbell -- --quick 2>/dev/null | grep -v '^\[' 
