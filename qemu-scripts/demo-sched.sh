#!/usr/bin/env bash
# The scheduled part of the demo (qemu-scripts/demo.sh runs it; it also runs alone once the
# release binaries and the guest image are built). No GPU needed: the daemon's simulated engine
# runs the load capset's command groups.
#
# `vgpu-bench live-switch` (tests/src/live_switch.rs) starts vgpu-schedd with policy none and
# boots two guests under it, each QEMU in its own CPU cgroup, each served by the host-guest
# control channel (vgpu-agent on a virtio-serial port): "bomb" keeps a GPU command bomb in
# flight (vgpu-load bomb), "game" renders frames (vgpu-load frames) in two phases. The
# workloads start only once both guests have booted; each phase is measured over a window in
# which both VMs must complete work all through and the expected policy must be in force at
# both ends. Between the phases, vgpuctl installs TimeGraph live
# (qemu-scripts/demo-timegraph.toml: the game HT at a high priority, the bomb PRT with a PE
# reserve). Each phase's end shows the daemon's `vgpuctl show`; the game stops when the host
# tells it to and sends its own summary back through the channel. The verdict compares the
# game's frame rate in the two phases only when every precondition held; otherwise it says
# which one failed and gives no ratio (exit code 3, reported here, the demo goes on).
#
# With --gl the game is glmark2 (glmark2-es2-drm, its `build` scene) on virgl instead: its
# SUBMIT_3D and 3D transfers are device-executed groups that the daemon grants and the device
# process renders on the host (llvmpipe), sharing the daemon's one GPU slot with the bomb's
# simulated groups. The verdict compares glmark2's own FPS in both phases.
#
# The daemon serves its live web dashboard on a loopback port (VGPU_DEMO_HTTP, default
# 127.0.0.1:0: a free port); its URL (from `vgpuctl dashboard`, token included) is printed as
# soon as the daemon is up: open it in a browser on this host (or through
# `ssh -L PORT:127.0.0.1:PORT`, same port on both sides) to watch the two VMs live.
# VGPU_DEMO_DASHBOARD_S keeps the daemon (and the page) up that many seconds more at the end
# (default 0). VGPU_DEMO_PHASE_S sets each phase's measured window in seconds (default 25).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
args=()
case ${1:-} in
    --gl) args=(--gl) ;;
    "") ;;
    *) echo "usage: $0 [--gl]" >&2; exit 2 ;;
esac
bin=${CARGO_TARGET_DIR:-target}/release
rc=0
"$bin/vgpu-bench" live-switch "${args[@]}" --phase-s "${VGPU_DEMO_PHASE_S:-25}" \
    --http "${VGPU_DEMO_HTTP:-127.0.0.1:0}" --linger-s "${VGPU_DEMO_DASHBOARD_S:-0}" || rc=$?
case $rc in
    0) ;;
    3) echo "(the live switch gave no verdict: a precondition failed, see above)" ;;
    *) exit "$rc" ;;
esac
