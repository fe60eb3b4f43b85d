#!/usr/bin/env bash
# The real-driver checks, for a GPU host that has no network or cargo.
#   qemu-scripts/nvcuda-check.sh build|run
# `build` (here) stages under target/cuda-h100 release builds of: the mdev-backend unit tests,
# the cuda_corpus tests, the compute_backend and cuda-remote benches, vgpu-cuda-host, our
# libcuda.so.1, the GCC OpenMP programs of the corpus and Debian's libgomp with its nvptx plugin.
# `run` (there, from a copy of the repository carrying that folder) then:
#   1. rebuilds the nvcc programs of the corpus with the host's own nvcc (a driver JIT-compiles
#      only PTX of a toolkit it knows; the wheel's may be newer than the driver);
#   2. runs the compute unit tests (conformance sequence and event-timed executor groups on
#      the real driver) and the differential check (qemu-scripts/cuda-differential.sh: the
#      corpus through the PTX executor and through NvCuda);
#   3. runs every corpus program natively (NVIDIA's cudart and driver), and the OpenMP
#      programs once natively and once through our libcuda.so.1 and vgpu-cuda-host on NvCuda,
#      comparing their output;
#   4. the benchmarks on NvCuda: compute_backend (criterion, short) and cuda-remote.
# Logs go to target/cuda-h100/out, packed into $OUT/results.tgz when $OUT is set; a summary line
# per step ends the output.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stage=target/cuda-h100
executable() {
    sed -n "s/.*\"executable\":\"\\([^\"]*$1[^\"]*\\)\".*/\\1/p" | tail -1
}
case "${1:-}" in
build)
    qemu-scripts/cuda-corpus.sh
    corpus=${VGPU_CUDA_CORPUS:-${VGPU_CACHE:-$HOME/.cache/vgpu}/cuda-corpus}
    rm -rf "$stage" && mkdir -p "$stage/lib" "$stage/omp" "$stage/gomp"
    cargo build -q --release -p mdev-backend --bin vgpu-cuda-host
    cargo build -q --release -p vgpu-libcuda --lib
    cp target/release/vgpu-cuda-host "$stage/"
    cp target/release/libcuda.so "$stage/lib/libcuda.so.1"
    cp "$(cargo test --release -p mdev-backend --lib --no-run --message-format=json 2>/dev/null |
        executable mdev_backend)" "$stage/mdev_backend_lib"
    cp "$(cargo test --release -p mdev-backend --test cuda_corpus --no-run --message-format=json \
        2>/dev/null | executable cuda_corpus)" "$stage/cuda_corpus"
    cp "$(cargo bench -p mdev-backend --bench compute_backend --no-run --message-format=json \
        2>/dev/null | executable compute_backend)" "$stage/compute_backend"
    cp "$(cargo bench -p vgpu-libcuda --bench remote --no-run --message-format=json \
        2>/dev/null | executable remote)" "$stage/cuda_remote"
    cp "$corpus"/omp_* "$stage/omp/"
    for l in libgomp.so.1 libgomp-plugin-nvptx.so.1; do
        cp -L "$(ldconfig -p | sed -n "s/.*$l (libc6,x86-64) => //p" | head -1)" "$stage/gomp/$l"
    done
    strip "$stage"/vgpu-cuda-host "$stage"/lib/* "$stage"/mdev_backend_lib "$stage"/cuda_corpus \
        "$stage"/compute_backend "$stage"/cuda_remote
    du -sh "$stage"
    ;;
run)
    out=$stage/out
    rm -rf "$out" && mkdir -p "$out"
    summary=()
    step() { # step NAME COMMAND...: runs COMMAND, its output to $out/NAME.log and the terminal
        local name=$1 rc=0
        shift
        echo "=== $name"
        "$@" 2>&1 | tee "$out/$name.log" || rc=$?
        summary+=("$(printf '%-22s %s' "$name" "$([[ $rc == 0 ]] && echo ok || echo "FAILED ($rc)")")")
    }
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt" || true
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    "$nvcc" --version | tail -2 | tee -a "$out/gpu.txt"
    corpus=$(mktemp -d)
    export VGPU_CUDA_CORPUS=$corpus VGPU_REQUIRE_CUDA_CORPUS=1
    cp "$stage"/omp/* "$corpus/"
    step corpus-build qemu-scripts/cuda-corpus.sh --nvcc "$nvcc"
    # The conformance sequence breaks CUDA for its process on purpose: a process of its own.
    step unit-tests "$stage/mdev_backend_lib" compute:: --test-threads=4 --nocapture \
        --skip the_conformance_sequence_on_the_real_driver
    step conformance "$stage/mdev_backend_lib" --exact \
        compute::conformance::the_conformance_sequence_on_the_real_driver --nocapture
    grep -h "skipped" "$out/unit-tests.log" && summary+=("unit-tests skipped some real-driver checks")
    step differential qemu-scripts/cuda-differential.sh "$stage/cuda_corpus"
    cp /tmp/cuda-differential-*.log "$out/"
    native() {
        local p b rc
        for p in "$corpus"/*; do
            b=$(basename "$p")
            [[ $b == spin ]] && continue # never ends, by design
            rc=0
            timeout 60 env LD_LIBRARY_PATH="$stage/gomp" OMP_TARGET_OFFLOAD=MANDATORY "$p" \
                >"$out/native-$b.txt" 2>"$out/native-$b.err" || rc=$?
            printf '%-26s rc=%-3s %s\n' "$b" "$rc" "$(tail -1 "$out/native-$b.txt")"
        done
    }
    step native native
    # Output compared with the native run's, the number of teams aside (libgomp derives it
    # from the device's and the kernel's attributes).
    same() { cmp -s <(sed 's/teams [0-9]*/teams N/' "$1") <(sed 's/teams [0-9]*/teams N/' "$2"); }
    remoted() {
        local sock=$corpus/host.sock host p b rc status=0 verdict
        "$stage/vgpu-cuda-host" --socket "$sock" --backend nvcuda 2>"$out/cuda-host.log" &
        host=$!
        for _ in {1..200}; do
            [[ -S $sock ]] && break
            sleep 0.05
        done
        for p in "$corpus"/omp_* "$corpus/vector_add" "$corpus/driver_bench"; do
            b=$(basename "$p")
            rc=0
            timeout 120 env LD_LIBRARY_PATH="$stage/lib:$stage/gomp" VGPU_CUDA_SOCKET="$sock" \
                VGPU_CUDA_TRACE=1 OMP_TARGET_OFFLOAD=MANDATORY "$p" \
                >"$out/remote-$b.txt" 2>"$out/remote-$b.err" || rc=$?
            if same "$out/remote-$b.txt" "$out/native-$b.txt"; then
                verdict="same output as native"
            else
                verdict="differs from native"
                [[ $b == omp_* ]] && status=1
            fi
            printf '%-26s rc=%-3s %s: %s\n' "$b" "$rc" "$verdict" "$(tail -1 "$out/remote-$b.txt")"
            grep -e ' -> ' -e 'not supported' "$out/remote-$b.err" | sort | uniq -c | head -20
        done
        kill "$host"
        wait "$host" || true
        cat "$out/cuda-host.log"
        return "$status"
    }
    step remote-libcuda remoted
    step bench-backend env VGPU_COMPUTE=nvcuda "$stage/compute_backend" --bench \
        --warm-up-time 1 --measurement-time 2
    step bench-remote env VGPU_COMPUTE=nvcuda VGPU_BENCH_OUT="$out/cuda-remote.json" "$stage/cuda_remote"
    rm -rf "$corpus"
    echo "=== summary"
    printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
    [[ -z ${OUT:-} ]] || tar czf "$OUT/results.tgz" -C "$out" .
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
