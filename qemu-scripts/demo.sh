#!/usr/bin/env bash
# The README's main job, on the embedded defaults (no GPU, no KVM needed: host llvmpipe, TCG):
# installs the QEMU prefix and the guest image, builds, starts `vgpu-server`, lets a QEMU
# (qtest, no guest OS) enumerate the vGPU and fetch its display info, boots a stock Debian guest
# that renders OpenGL (kmscube) through the vGPU and writes what its screen shows to a PNG, then
# shares the vGPU between two guests under the vgpu-schedd daemon, switching its policy live
# from none to TimeGraph (qemu-scripts/demo-sched.sh), runs stock CUDA clients (unmodified
# nvcc-built programs and a GCC OpenMP-offloading one) in a guest on the vGPU's compute capset
# (PTX executor on the host's CPUs) while a second guest renders GL, then the doorbell benchmark
# and the simulator's scheduling experiments, and points to docs/EXPERIMENTS.md.
# --gl: the scheduled game is glmark2 on virgl instead of the simulated frame workload
# (demo-sched.sh --gl). --experiment NAME: also runs that paper experiment on real guests
# (vgpu-bench run scheduler/scenarios/NAME.toml --on vms --quick), beside the simulator.
set -euo pipefail
usage="usage: $0 [--gl] [--experiment timegraph|pegasus|pegasus-deep|vgris]"
sched_args=()
experiment=
while (($#)); do
    case $1 in
        --gl) sched_args=(--gl) ;;
        --experiment) experiment=${2:?$usage}; shift ;;
        --experiment=*) experiment=${1#--experiment=} ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
    shift
done
STEPS=10
[[ -z $experiment ]] || STEPS=11
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [[ -n $experiment && ! -f scheduler/scenarios/$experiment.toml ]]; then
    echo "no scheduler/scenarios/$experiment.toml; $usage" >&2
    exit 2
fi

step "build (release)"
cargo build --release --locked -p vgpu-server -p vgpu-tests -p vgpu-sim -p vgpu-schedd --bins
cargo build --release --locked -p vgpu-libcuda --lib

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

step "CUDA corpus (nvcc from PyPI wheels, GCC nvptx offloading; tests/cuda)"
qemu-scripts/cuda-corpus.sh

step "guest image (Debian trixie)"
qemu-scripts/build-guest-image.sh

step "a stock guest renders OpenGL through the vGPU (TCG, about a minute)"
out=${VGPU_DEMO_OUT:-target/vgpu-demo}
mkdir -p "$out"
# kmscube reads stdin as "quit": it gets a pipe nothing writes to, and keeps drawing until the
# job ends and the guest powers off; the server writes the last frame at disconnect.
target/release/vgpu-run-vm --timeout 300 --server-arg --dump-dir --server-arg "$out" --job '
eglinfo -B -p gbm 2>/dev/null | grep -m1 "OpenGL ES profile renderer"
(kmscube < <(sleep 600) > /dev/null 2>&1 &)
sleep 10
echo "kmscube running for 10 s"'
echo "the guest's screen, as the vGPU scanned it out: $out/scanout0.png"

step "two guests share the vGPU under vgpu-schedd: policy none, then TimeGraph live (about 2 minutes; it prints the live dashboard's URL)"
qemu-scripts/demo-sched.sh "${sched_args[@]}"

step "stock CUDA clients in one guest (nvcc-built, OpenMP offload), a GL guest beside it (TCG, about a minute)"
# The GL guest: kmscube for 30 s on its own vGPU, while the CUDA guest runs; its last frame is
# written at disconnect.
target/release/vgpu-run-vm --timeout 300 --server-arg --dump-dir --server-arg "$out/beside-cuda" --job '
(kmscube < <(sleep 600) > /dev/null 2>&1 &)
sleep 30
echo "GL guest: kmscube drew for 30 s beside the CUDA guest"' >"$out/gl-beside-cuda.log" 2>&1 &
gl_guest=$!
target/release/vgpu-run-vm --timeout 300 --cuda --job '
cd /tmp/work/cuda
echo "$ ./vector_add   (built by nvcc 13.5 with its default static cudart, unmodified)"
./vector_add
echo "$ ./hello   (device printf)"
./hello
echo "$ ./device_query && ./matmul && ./streams_events"
./device_query && ./matmul && ./streams_events
echo "$ ./omp_features   (GCC OpenMP offload; OMP_TARGET_OFFLOAD=MANDATORY: it must run on the vGPU)"
./omp_features
echo "$ ./driver_bench 500 4   (the driver API from C: launch to completion, copies)"
./driver_bench 500 4'
wait "$gl_guest" || { cat "$out/gl-beside-cuda.log"; exit 1; }
tail -n 3 "$out/gl-beside-cuda.log"
echo "the GL guest's last frame: $out/beside-cuda/scanout0.png"

step "doorbell benchmark (quick)"
cargo bench --locked -p vgpu-tests --bench doorbell -- --quick 2>/dev/null | grep -v '^\[' 

step "scheduling policies in the simulator (the papers' experiments)"
target/release/vgpu-sim --all scheduler/scenarios --out "$out/sim"
echo "tables, JSON, CSV and SVG plots of every experiment: $out/sim/ (docs/SCHEDULING.md explains them)"

if [[ -n $experiment ]]; then
    step "the $experiment experiment on real guests, beside the simulator (quick: a few minutes)"
    # A run whose preconditions failed twice (a VM idle in its window, or starved of CPU by
    # the host) is left out of the table and makes vgpu-bench exit 1: the demo says so.
    target/release/vgpu-bench run "scheduler/scenarios/$experiment.toml" --on vms --quick \
        --out "$out/bench" ||
        echo "(some runs of $experiment were excluded or failed: see the lines above; no verdict for them)"
fi
echo
echo "The papers' experiments in the simulator and on real guests, side by side: docs/EXPERIMENTS.md"
echo "(run one on guests: qemu-scripts/demo.sh --experiment timegraph, or target/release/vgpu-bench)"
