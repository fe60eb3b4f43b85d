#!/usr/bin/env bash
# Builds the fuzz targets in fuzz/ (libFuzzer through libfuzzer-sys, stable toolchain, SanitizerCoverage
# instrumentation, no ASan; docs/FUZZING.md) and runs every target (or those named), two at a time,
# each from a copy of its checked-in seed corpus, under its resource limits (limits_of below): an
# input longer than a run takes (-timeout) or a process whose peak RSS passes its limit
# (-rss_limit_mb, and the peak checked again at the end) is a failure. Prints a table (target,
# executions, exec/s, peak RSS, crashes) and writes it as JSON.
#
#   qemu-scripts/fuzz.sh [--smoke | --long | --corpus] [TARGET...]
#     --smoke   a few seconds per target (FUZZ_SECONDS, default 3): CI's run
#     --long    FUZZ_RUNS executions per target (default 10^7), each stopped after FUZZ_MAX_SECONDS
#               (default 3600) if it has not got there
#     --corpus  every input of the committed corpus run once, nothing mutated: the regression
#               check of the limits (a second or so per target)
#   FUZZ_JOBS   targets run at once (default 2)
#   FUZZ_WORKERS  processes per target sharing its corpus (default 1; each gets FUZZ_RUNS/WORKERS
#               executions, the table sums them): for machines with many cores
#   FUZZ_BIN_DIR  run the targets built there instead of building them (a machine without cargo)
#   FUZZ_OUT    where corpora, logs, crash artifacts and fuzz-MODE.json go (default fuzz/out)
#
# Exit status: 0 when every target ran without a crash, 1 otherwise.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=smoke
targets=()
for arg in "$@"; do
    case $arg in
        --smoke) mode=smoke ;;
        --long) mode=long ;;
        --corpus) mode=corpus ;;
        -*) echo "usage: $0 [--smoke|--long|--corpus] [TARGET...]" >&2; exit 2 ;;
        *) targets+=("$arg") ;;
    esac
done
all=(vfio_user_stream daemon_proto virtqueue dma_irq control_requests pci_config gpu_commands
     compute_module compute_wire http_head cgroup_proc sched_proto guest_control)
((${#targets[@]})) || targets=("${all[@]}")

out=$(realpath -m "${FUZZ_OUT:-fuzz/out}")
mkdir -p "$out"
case $mode in
    smoke) limits=(-max_total_time="${FUZZ_SECONDS:-3}") ;;
    long) workers=${FUZZ_WORKERS:-1}
          limits=(-runs="$(( ${FUZZ_RUNS:-10000000} / workers ))" -max_total_time="${FUZZ_MAX_SECONDS:-3600}") ;;
    corpus) limits=(-runs=0) ;;
esac

# Each target's input length and resource limits, as libFuzzer flags. -max_len: the longest
# input the fuzzer makes. -timeout: seconds one input may take (libFuzzer checks every second),
# past which it is a failure with the input saved. -rss_limit_mb: the process's peak RSS, past
# which it is a failure (libFuzzer looks once a second; run_one checks the peak again at the
# end, so a spike in a short run counts too). -malloc_limit_mb is not passed: libFuzzer sees
# allocations only through a sanitizer's malloc hooks, which these builds (no ASan) do not
# have, so the RSS limit and the targets' own memory budgets are the memory check.
limits_of() {
    case $1 in
        # 256 KiB: a raw stream with thousands of nested batches (20,000 in 200 KB overflowed
        # the decoding thread's stack before they were refused from their opcode). 3 s: a
        # stream is at most 64 requests of a 20,000 warp-instruction budget each, served in
        # well under 100 ms. 512 MiB: the target's memory budget is 64 MiB and the process
        # idles at 30 MiB; more means something the guest sends is held outside the budget.
        compute_wire) echo -max_len=262144 -timeout=3 -rss_limit_mb=512 ;;
        # 1 MiB: a raw fat binary with several compressed entries and PTX texts deep enough
        # for nesting and bombs (the structured modes build bigger ones from small inputs).
        # 5 s: the slowest inputs accepted (a bomb that fits the budget: tens of MiB of PTX
        # decompressed and parsed; a 1 MiB raw text) take 0.1 to 0.6 s on a busy 2-core
        # machine. 512 MiB: a 64 MiB budget, so a decompression or parse bomb is refused at
        # the budget; past 512 MiB it was allocated anyway.
        compute_module) echo -max_len=1048576 -timeout=5 -rss_limit_mb=512 ;;
        # The device, daemon and parser targets: sequences of operations in 4 KiB; 10 s and
        # 2 GiB only catch hangs and runaway growth (their inputs bound nothing larger).
        *) echo -max_len=4096 -timeout=10 -rss_limit_mb=2048 ;;
    esac
}

# What cargo-fuzz passes with -Zsanitizer=none, which stable rustc takes: libFuzzer's coverage
# feedback (8-bit counters, the PC table, comparison tracing). --target keeps the flags off build
# scripts and proc macros, which are not linked with libFuzzer.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
if [[ -n ${FUZZ_BIN_DIR:-} ]]; then
    bindir=$(realpath "$FUZZ_BIN_DIR")
else
    triple=$(rustc -vV | sed -n 's/^host: //p')
    echo "building fuzz targets (release, $triple)"
    bins=()
    for t in "${targets[@]}"; do bins+=(--bin "$t"); done
    cargo build --manifest-path fuzz/Cargo.toml --locked --release --target "$triple" "${bins[@]}"
    bindir=$(realpath "fuzz/target/$triple/release")
fi

run_one() {
    local t=$1 dir=$out/$mode/$1
    rm -rf "$dir"
    mkdir -p "$dir/corpus" "$dir/artifacts" "$dir/tmp"
    cp fuzz/corpus/"$t"/* "$dir/corpus/"
    local rc=0 start=$SECONDS w pids=() own peak rss_limit
    read -r -a own <<<"$(limits_of "$t")"
    rss_limit=$(printf '%s\n' "${own[@]}" | sed -n 's/^-rss_limit_mb=//p')
    # The vfio-user target puts its listening socket in TMPDIR. Workers share the corpus
    # (libFuzzer reloads it) and each writes its own log.
    for ((w = 0; w < ${FUZZ_WORKERS:-1}; w++)); do
        TMPDIR=$dir/tmp "$bindir/$t" "${limits[@]}" "${own[@]}" \
            -print_final_stats=1 -artifact_prefix="$dir/artifacts/" "$dir/corpus" >"$dir/log.$w" 2>&1 &
        pids+=($!)
    done
    for w in "${pids[@]}"; do wait "$w" || rc=$?; done
    peak=$(cat "$dir"/log.* | sed -n 's/^stat::peak_rss_mb: *//p' | sort -n | tail -1)
    echo "${peak:-0}" >"$dir/peak_rss_mb"
    if ((${peak:-0} > rss_limit)); then
        echo "  $t: peak RSS ${peak} MiB is over its limit of ${rss_limit} MiB" >&2
        rc=1
    fi
    echo "$rc" >"$dir/rc"
    echo $((SECONDS - start)) >"$dir/seconds"
    echo "  $t done (exit $rc)"
}
export -f run_one limits_of
export out mode bindir FUZZ_WORKERS
export limits_str="${limits[*]}"

echo "running ${#targets[@]} target(s), mode $mode, ${FUZZ_JOBS:-2} at a time; logs in $out/$mode"
# shellcheck disable=SC2016
printf '%s\n' "${targets[@]}" |
    xargs -P "${FUZZ_JOBS:-2}" -I{} bash -c 'limits=($limits_str); run_one "$1"' _ {}

status=0
json="$out/fuzz-$mode.json"
{
    printf '{"mode": "%s", "limits": "%s", "targets": [' "$mode" "${limits[*]}"
    sep=
    printf '%-18s %14s %10s %8s %8s %8s\n' target executions exec/s seconds rss_mb crashes >&2
    for t in "${targets[@]}"; do
        dir=$out/$mode/$t
        runs=$(cat "$dir"/log.* | sed -n 's/^stat::number_of_executed_units: *//p' | awk '{s += $1} END {print s + 0}')
        secs=$(cat "$dir/seconds")
        rate=$(cat "$dir"/log.* | sed -n 's/^stat::average_exec_per_sec: *//p' | awk '{s += $1} END {print s + 0}')
        crashes=$(find "$dir/artifacts" -type f | wc -l)
        rc=$(cat "$dir/rc")
        peak=$(cat "$dir/peak_rss_mb")
        if ((crashes > 0 || rc != 0)); then status=1; fi
        printf '%-18s %14s %10s %8s %8s %8s\n' "$t" "$runs" "$rate" "$secs" "$peak" "$crashes" >&2
        printf '%s{"target": "%s", "limits": "%s", "executions": %s, "exec_per_sec": %s, "seconds": %s, "peak_rss_mb": %s, "crashes": %s, "exit": %s}' \
            "$sep" "$t" "$(limits_of "$t")" "$runs" "$rate" "$secs" "$peak" "$crashes" "$rc"
        sep=', '
    done
    printf ']}\n'
} >"$json"
echo "written: $json"
exit "$status"
