#!/usr/bin/env bash
# Builds the CUDA test corpus (tests/cuda/*.cu with nvcc's default options, vector_add once
# more per fat-binary compression mode, with the shared cudart 13 (next to it, found through
# its rpath) and with the static cudart 12.9 (linked to nvcc 13's objects: the runtime's
# bootstrap with a CUDA 12 driver interface), tests/cuda/omp/*.c with GCC's nvptx offloading, and
# the driver-API benchmark tests/cuda/bench/driver_bench.c with plain gcc) into
# ${VGPU_CUDA_CORPUS:-$CACHE/cuda-corpus}. nvcc comes from NVIDIA's PyPI wheels, unpacked into
# $CACHE/cuda with the header-only wheels a full toolkit has (CCCL: thrust, cub, <nv/target>;
# the profiler API; NVTX 3), so stock programs using those build too; GCC's offloading from
# Debian's gcc-offload-nvptx. Nothing needs a GPU; nothing NVIDIA ships enters the repository.
# Idempotent: a program is rebuilt only when what it is built from changed (by content).
# docs/PTX.md says what the tests do with the corpus.
#   qemu-scripts/cuda-corpus.sh [--nvcc PATH]
# --nvcc PATH: the nvcc programs only, built by that compiler (a GPU host whose driver is older
# than the wheel's toolkit JIT-compiles only the PTX of a toolkit it knows).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source qemu-scripts/progress.sh
started=$SECONDS
cache=${VGPU_CACHE:-$HOME/.cache/vgpu}
corpus=${VGPU_CUDA_CORPUS:-$cache/cuda-corpus}
cuda=$cache/cuda
# Pinned so the corpus (and its PTX) is the same on every machine.
version=13.5.37
cudart12=12.9.79
# The header-only parts of a full toolkit, unpacked into the same tree so nvcc finds them as it
# would in /usr/local/cuda: CCCL (<nv/target> for cooperative_groups.h and cuda_fp16.h, thrust,
# cub, cuda/std in include/cccl, which nvcc.profile already adds as a system include), the
# profiler API (cuda_profiler_api.h) and NVTX 3 (nvtx3/). CCCL has no 13.5 wheel; 13.3.5.0.6 is
# the newest and compiles with nvcc 13.5 (CCCL supports the toolkits of its major version).
cccl=13.3.5.0.6
headers=13.5.25
wheels=("nvidia-cuda-nvcc==$version" "nvidia-cuda-crt==$version" "nvidia-cuda-runtime==$version"
        "nvidia-nvvm==$version" "nvidia-cuda-runtime-cu12==$cudart12"
        "nvidia-cuda-cccl==$cccl" "nvidia-cuda-profiler-api==$headers" "nvidia-nvtx==$headers")
stamp="$version cudart12 $cudart12 cccl $cccl profiler-api nvtx $headers"

own_nvcc=
if [[ ${1:-} == --nvcc ]]; then
    own_nvcc=${2:?usage: $0 [--nvcc PATH]}
fi
if [[ -n $own_nvcc ]]; then
    nvcc=("$own_nvcc")
else
    if [[ ! -x $cuda/nvidia/cu13/bin/nvcc || $(cat "$cuda/version" 2>/dev/null) != "$stamp" ]]; then
        echo "installing nvcc $version and the toolkit's headers from PyPI wheels into $cuda (${#wheels[@]} wheels)"
        rm -rf "$cuda.tmp" && mkdir -p "$cuda.tmp/wheels"
        bar=off
        ((PROGRESS_TTY)) && bar=on
        python3 -m pip download -q --progress-bar "$bar" --no-deps --only-binary=:all: \
            -d "$cuda.tmp/wheels" "${wheels[@]}"
        echo "  downloaded $(du -sh "$cuda.tmp/wheels" | cut -f1) in $(elapsed "$started")"
        for w in "$cuda.tmp/wheels"/*.whl; do
            echo "  unpacking $(basename "$w") ($(elapsed "$started"))"
            python3 -m zipfile -e "$w" "$cuda.tmp"
        done
        rm -rf "$cuda.tmp/wheels"
        chmod +x "$cuda.tmp"/nvidia/cu13/bin/* "$cuda.tmp"/nvidia/cu13/nvvm/bin/*
        # The toolkit is complete when a program using every header-only part compiles.
        echo "  checking the headers: cooperative groups, fp16, thrust, profiler API, NVTX 3 ($(elapsed "$started"))"
        printf '%s\n' '#include <cooperative_groups.h>' '#include <cuda_fp16.h>' \
            '#include <thrust/device_vector.h>' '#include <cuda_profiler_api.h>' \
            '#include <nvtx3/nvToolsExt.h>' \
            '__global__ void k(__half *h) { cooperative_groups::this_thread_block().sync(); h[0] = __float2half(1.0f); }' \
            'int main() { thrust::device_vector<int> v(4); nvtxRangePushA("check"); nvtxRangePop(); return cudaProfilerStart() == cudaSuccess ? 0 : v.size() > 0; }' \
            >"$cuda.tmp/check.cu"
        env "PATH=$cuda.tmp/nvidia/cu13/bin:$PATH" nvcc -c -o /dev/null "$cuda.tmp/check.cu"
        rm -f "$cuda.tmp/check.cu"
        echo "$stamp" >"$cuda.tmp/version"
        rm -rf "$cuda" && mv "$cuda.tmp" "$cuda"
    fi
    if ! dpkg-query -W -f='${Status}' gcc-offload-nvptx 2>/dev/null | grep -q 'install ok installed'; then
        sudo=()
        [[ $(id -u) == 0 ]] || sudo=(sudo)
        echo "installing Debian package gcc-offload-nvptx"
        "${sudo[@]}" apt-get update -q
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends gcc-offload-nvptx
    fi
    # nvcc finds cicc and ptxas through PATH; GCC's nvptx assembler must not (it would verify
    # its sm_30 PTX with a ptxas that no longer knows sm_30).
    nvcc=(env "PATH=$cuda/nvidia/cu13/bin:$PATH" nvcc)
fi

mkdir -p "$corpus"
cu=(tests/cuda/*.cu)
omp=(tests/cuda/omp/*.c)
# Programs: each .cu, three compress modes, driver_bench; with the wheels' nvcc also the two
# cudart builds, libcudart and the OpenMP offload programs.
total=$((${#cu[@]} + 3 + 1))
[[ -n $own_nvcc ]] || total=$((total + 3 + ${#omp[@]}))
built=0
# What a program is built with besides its source and this script: the compilers.
toolchain="${own_nvcc:-nvcc $stamp} / $(gcc -dumpfullversion)"
keys=$corpus/.keys
mkdir -p "$keys"
# build OUT SRC COMMAND...: runs COMMAND when OUT is missing or was built from other inputs. The
# key hashes contents (SRC, tests/cuda/common.h, this script, the toolchain), not times: in a fresh
# clone every source is newer than the cache, and a rebuilt program differs in its bytes, which
# would change the guest image's fingerprint (it hashes the corpus) and rebuild the image too.
build() {
    local out=$1 src=$2 t=$SECONDS key
    shift 2
    built=$((built + 1))
    key=$({ printf '%s\n' "$toolchain"; cat "$src" tests/cuda/common.h "$0"; } | sha256sum | cut -d' ' -f1)
    if [[ -e $corpus/$out && $(cat "$keys/$out" 2>/dev/null) == "$key" ]]; then
        return 0
    fi
    echo "  [$built/$total] $out"
    rm -f "$keys/$out"
    "$@"
    echo "$key" >"$keys/$out"
    echo "      done in $(elapsed "$t")"
}
echo "building the CUDA corpus in $corpus ($total programs; up-to-date ones are skipped)"
for src in "${cu[@]}"; do
    name=$(basename "$src" .cu)
    build "$name" "$src" "${nvcc[@]}" -o "$corpus/$name" "$src"
done
for mode in none speed size; do
    build "vector_add.compress-$mode" tests/cuda/vector_add.cu \
        "${nvcc[@]}" -compress-mode="$mode" -o "$corpus/vector_add.compress-$mode" tests/cuda/vector_add.cu
done
if [[ -z $own_nvcc ]]; then
    # The wheel has the runtime's soname only; the linker looks for libcudart.so.
    ln -sf libcudart.so.13 "$cuda/nvidia/cu13/lib/libcudart.so"
    build libcudart.so.13 "$cuda/nvidia/cu13/lib/libcudart.so.13" \
        cp "$cuda/nvidia/cu13/lib/libcudart.so.13" "$corpus/"
    build vector_add.cudart-shared tests/cuda/vector_add.cu "${nvcc[@]}" -cudart shared \
        -Xlinker -rpath -Xlinker "\$ORIGIN" -o "$corpus/vector_add.cudart-shared" tests/cuda/vector_add.cu
    build vector_add.cudart12 tests/cuda/vector_add.cu bash -c '
        set -e; o=$(mktemp --suffix=.o); trap "rm -f $o" EXIT
        "${@:3}" -c -o "$o" tests/cuda/vector_add.cu
        g++ -o "$1" "$o" "$2" -ldl -lpthread -lrt' _ "$corpus/vector_add.cudart12" \
        "$cuda/nvidia/cuda_runtime/lib/libcudart_static.a" "${nvcc[@]}"
fi
for src in "${omp[@]}"; do
    [[ -z $own_nvcc ]] || break
    name=omp_$(basename "$src" .c)
    build "$name" "$src" gcc -O2 -fopenmp -foffload=nvptx-none -foffload-options=-lm \
        -Wno-error -o "$corpus/$name" "$src"
done
# The driver-API benchmark: plain C, whatever libcuda.so.1 the loader finds.
build driver_bench tests/cuda/bench/driver_bench.c \
    gcc -O2 -Wall -Werror -o "$corpus/driver_bench" tests/cuda/bench/driver_bench.c -ldl
echo "corpus: $(find "$corpus" -maxdepth 1 -type f | wc -l) programs in $corpus ($(elapsed "$started"))"
