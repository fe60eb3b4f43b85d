#!/usr/bin/env bash
# Boots the test guest (qemu-scripts/build-guest-image.sh) with a GPU and runs one job in it: a thin
# wrapper that builds vgpu-server and the launcher (tests/src/bin/vgpu-run-vm.rs, release) and runs
# the launcher with these arguments. Exits with the job's exit code. Examples:
#   qemu-scripts/run-vm.sh --job 'lspci -nn; cat /sys/class/drm/card0-Virtual-1/modes'
#   qemu-scripts/run-vm.sh --gpu virtio-gpu --job-file job.sh --serial
#   qemu-scripts/run-vm.sh --help
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo build --release --locked --quiet -p vgpu-server -p vgpu-tests --bin vgpu-server --bin vgpu-run-vm
exec cargo run --release --locked --quiet -p vgpu-tests --bin vgpu-run-vm -- "$@"
