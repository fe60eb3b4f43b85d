#!/usr/bin/env bash
# The scheduled part of the demo (qemu-scripts/demo.sh runs it; it also runs alone once the
# release binaries and the guest image are built). No GPU needed: the daemon's simulated engine
# runs the load capset's command groups.
#
# vgpu-schedd starts with policy none. Two guests share it, each QEMU in its own CPU cgroup:
# "bomb" keeps a GPU command bomb in flight (vgpu-load bomb), "game" renders frames
# (vgpu-load frames) in two phases. Between them, vgpuctl installs TimeGraph live
# (qemu-scripts/demo-timegraph.toml: the game HT at a high priority, the bomb PRT with a PE
# reserve). A vgpuctl table shows the VMs' frame rates and GPU shares meanwhile; the summary
# compares the game's frame rate (from its vgpu-load summary lines) in both phases.
#
# With --gl the game is glmark2 (glmark2-es2-drm, its `build` scene) on virgl instead: its
# SUBMIT_3D and 3D transfers are device-executed groups that the daemon grants and the device
# process renders on the host (llvmpipe), sharing the daemon's one GPU slot with the bomb's
# simulated groups. It draws on-screen, so each page flip's RESOURCE_FLUSH is a frame the daemon
# counts (its fps column). The summary compares glmark2's own FPS in both phases.
#
# The daemon serves its live web dashboard on a loopback port (VGPU_DEMO_HTTP, default
# 127.0.0.1:0: a free port); the demo prints its URL (from `vgpuctl dashboard`, token
# included) as soon as the daemon is up: open it in a browser on this host (or through
# `ssh -L PORT:127.0.0.1:PORT`, same port on both sides) to watch the two VMs live. The page
# stays live while the demo runs; VGPU_DEMO_DASHBOARD_S keeps the daemon (and the page) up
# that many seconds more at the end (default 0).
#
# VGPU_DEMO_PHASE_S sets the length of each game phase in seconds (default 25).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
gl=false
case ${1:-} in
    --gl) gl=true ;;
    "") ;;
    *) echo "usage: $0 [--gl]" >&2; exit 2 ;;
esac
bin=${CARGO_TARGET_DIR:-target}/release
phase_s=${VGPU_DEMO_PHASE_S:-25}
# glmark2 starts slowly under TCG (GL set-up, shader compiles in the guest): seconds per phase;
# its guest also boots more slowly next to the bomb (seconds more for the bomb to run).
startup_s=0
boot_s=40
$gl && startup_s=10 && boot_s=60
# The bomb outlasts both game phases, the game's boot and the pause between the phases.
bomb_s=$((2 * (phase_s + startup_s) + boot_s))
# One vgpuctl row every 5 s from the game's start to its end.
rows=$(((2 * (phase_s + startup_s) + 15) / 5))
policy=qemu-scripts/demo-timegraph.toml
http=${VGPU_DEMO_HTTP:-127.0.0.1:0}
linger_s=${VGPU_DEMO_DASHBOARD_S:-0}

run=$(mktemp -d "${TMPDIR:-/tmp}/vgpu-sched-demo.XXXXXX")
pids=()
cleanup() {
    local pid
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    rm -rf "$run"
}
trap cleanup EXIT

ctl() {
    echo "\$ vgpuctl $*"
    "$bin/vgpuctl" --control "$run/control.sock" "$@" | sed 's/^/  /'
}

"$bin/vgpu-schedd" --socket "$run/sched.sock" --control "$run/control.sock" \
    --http "$http" --log-level info 2> "$run/schedd.log" &
schedd_pid=$!
pids+=("$schedd_pid")
for _ in $(seq 100); do [[ -S $run/control.sock ]] && break; sleep 0.05; done
[[ -S $run/control.sock ]] || { cat "$run/schedd.log"; exit 1; }
echo "vgpu-schedd is up (policy none); its device socket: $run/sched.sock"
url=$("$bin/vgpuctl" --control "$run/control.sock" dashboard)
echo "live dashboard (open it in a browser while the demo runs): $url"

declare -A vm_pid
# Boots one VM against the daemon; its job's output goes to $run/NAME.out.
start_vm() {
    local name=$1 job=$2
    "$bin/vgpu-run-vm" --timeout $((bomb_s + 180)) --scheduler "$run/sched.sock" \
        --vm-name "$name" --cgroup "vgpu-demo-$name-$$" --job "$job" \
        > "$run/$name.out" 2> "$run/$name.err" &
    pids+=($!)
    vm_pid[$name]=$!
}
wait_for() {
    local file=$1 text=$2 limit=$3
    for _ in $(seq $((limit * 5))); do
        grep -q "$text" "$file" 2>/dev/null && return 0
        sleep 0.2
    done
    echo "timed out waiting for \"$text\" in $file:" >&2
    cat "$file" "${file%.out}.err" >&2 || true
    return 1
}

echo "booting bomb (vgpu-load bomb: 8 groups of 4 ms in flight for ${bomb_s} s)"
start_vm bomb "echo bomb starts; vgpu-load bomb --cost-us 4000 --depth 8 --duration-s $bomb_s --json | grep '\"summary\"'"
wait_for "$run/bomb.out" "bomb starts" 240
if $gl; then
    echo "booting game (glmark2-es2-drm on virgl, on-screen 640x480, two ${phase_s}-s phases)"
    # glmark2 needs an opaque visual on virtio-gpu and a size below the EDID mode (DESIGN §4).
    workload="glmark2-es2-drm -s 640x480 --visual-config alpha=0 -b build:duration=$phase_s 2>&1 |
        grep -E '^ *\\[build\\]|Score:'"
else
    echo "booting game (vgpu-load frames: 1 ms CPU + 4 groups of 2 ms per frame, two ${phase_s}-s phases)"
    workload="vgpu-load frames --groups 4 --cost-us 2000 --cpu-us 1000 --fps-target 60 \
        --duration-s $phase_s --json | grep '\"summary\"'"
fi
start_vm game "
sleep 2
for phase in 1 2; do
    echo \"game phase \$phase starts\"
    $workload | sed \"s/^/PHASE\$phase /\"
    [ \$phase = 1 ] && echo 'game phase 1 done' && sleep 3
done
true"
wait_for "$run/game.out" "game phase 1 starts" 240
sed -n 's/^vgpu-run-vm: //p' "$run/bomb.err" "$run/game.err" | grep cgroup | sed 's/^/  /'
ctl list

# Half-way: TimeGraph replaces policy none while both VMs keep running.
(
    wait_for "$run/game.out" "game phase 1 done" $((phase_s + 60))
    echo "---- the game's first phase is over: switching the policy live ----"
    ctl set-policy "$policy"
    ctl list
) > "$run/switch.log" 2>&1 &
switcher=$!
pids+=("$switcher")
# The daemon's view: the game's frame rate over its 5-s window (word 6 of its `vgpuctl show`
# row, "game 0 connected 45.2 % 59.8 fps ...") every 2 s while a phase's workload runs and has
# drawn (fps above 0), tagged with the phase.
(
    while kill -0 "${vm_pid[game]}" 2>/dev/null; do
        phase=$(grep -c '^game phase [12] starts' "$run/game.out" || true)
        if ((phase > 0)) && ! grep -q "^PHASE$phase " "$run/game.out" &&
            ! grep -q "^game phase $phase done" "$run/game.out"; then
            "$bin/vgpuctl" --control "$run/control.sock" show |
                awk -v p="$phase" '$1 == "game" && $6 > 0 { print "PHASE" p, $6 }'
        fi
        sleep 2
    done
) > "$run/daemon-fps" 2>/dev/null &
sampler=$!
pids+=("$sampler")
# The table (every 5 s) interleaved with the switch's transcript once it happens.
(tail -n +1 -F "$run/switch.log" 2>/dev/null &
    tail_pid=$!
    "$bin/vgpuctl" --control "$run/control.sock" show --watch 5 --count "$rows"
    kill "$tail_pid")
wait "$switcher"
for vm in game bomb; do
    wait "${vm_pid[$vm]}" || {
        echo "the $vm VM failed:"
        tail -n 20 "$run/$vm.out" "$run/$vm.err"
        exit 1
    }
done
wait "$sampler" || true
# Only the daemon is left to stop (the trap sends it SIGTERM).
pids=("$schedd_pid")

field() { sed -n "s/.*\"$2\":\([0-9.]*\).*/\1/p" <<< "$1"; }
# glmark2's own figure: "[build] <options>: FPS: N FrameTime: T ms".
glmark2_fps() { sed -n 's/.*\[build\].*FPS: *\([0-9.]*\).*/\1/p' <<< "$1"; }
# The median of a phase's samples.
daemon_fps() {
    sed -n "s/^PHASE$1 //p" "$run/daemon-fps" 2>/dev/null | sort -n |
        awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print "?" }'
}
one=$(grep '^PHASE1 ' "$run/game.out" | grep -m1 -e '\[build\]' -e '"summary"' || true)
two=$(grep '^PHASE2 ' "$run/game.out" | grep -m1 -e '\[build\]' -e '"summary"' || true)
bomb=$(grep -m1 '"summary"' "$run/bomb.out" || true)
echo
if $gl; then
    fps1=$(glmark2_fps "$one")
    fps2=$(glmark2_fps "$two")
    echo "game (glmark2 build), policy none, bomb running:     ${fps1:-?} fps" \
        "(daemon: $(daemon_fps 1) fps)"
    echo "game (glmark2 build), TimeGraph (live), bomb running: ${fps2:-?} fps" \
        "(daemon: $(daemon_fps 2) fps)"
else
    fps1=$(field "$one" fps)
    fps2=$(field "$two" fps)
    echo "game, policy none, bomb running:    $fps1 fps," \
        "group latency p50 $(field "$one" latency_p50_us) us, p99 $(field "$one" latency_p99_us) us" \
        "(daemon: $(daemon_fps 1) fps)"
    echo "game, TimeGraph (live), bomb running: $fps2 fps," \
        "group latency p50 $(field "$two" latency_p50_us) us, p99 $(field "$two" latency_p99_us) us" \
        "(daemon: $(daemon_fps 2) fps)"
fi
[[ -n $bomb ]] && echo "bomb over the whole run: $(field "$bomb" groups) groups"
awk -v a="${fps1:-0}" -v b="${fps2:-0}" \
    'BEGIN { if (a > 0) printf "TimeGraph gives the game %.1fx the frame rate it had without scheduling\n", b / a }'
if ((linger_s > 0)); then
    echo "the dashboard stays up for ${linger_s} s more: $url"
    sleep "$linger_s"
fi
