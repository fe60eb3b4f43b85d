#!/usr/bin/env bash
# Builds and runs a selection of NVIDIA's cuda-samples from a local checkout (never fetched
# here) through our libcuda.so.1 against a vgpu-cuda-host this script starts on a private
# socket (the host path), or in one guest through the vGPU (--guest), and prints a table:
# each sample's result (pass, fail, waived, timeout, build-fail), the reason and the seconds.
#
#   qemu-scripts/cuda-samples.sh --samples DIR [--guest] [--only NAME...] [--timeout S]
#                                [--json FILE] [--profile debug|release] [--list]
#                                [--lib PATH --host PATH]
#   qemu-scripts/cuda-samples.sh --self-check [--profile P | --lib PATH --host PATH]
#
# --samples DIR: a work tree of github.com/NVIDIA/cuda-samples (its Samples/ and Common/).
# --guest: run them in the test guest (qemu-scripts/build-guest-image.sh) booted by
#   target/P/vgpu-run-vm with our vgpu-server: the built samples, their directories' files,
#   Common/data and our libcuda.so.1 go to the guest on a read-only ext4 disk (as the guest
#   tests hand over the corpus), one guest runs them all in turn with the same timeout and
#   prints each one's exit status and output between markers, classified as on the host.
# --only NAME...: these samples of the selection only (names as in the table).
# --timeout S: each sample's run is stopped after S seconds (default 120).
# --json FILE: the table as JSON too.
# --profile P: which build of ours runs them: target/P/libcuda.so and target/P/vgpu-cuda-host
#   (default debug; build them with `cargo build -p vgpu-libcuda -p mdev-backend`).
# --lib PATH, --host PATH: our libcuda.so and vgpu-cuda-host from elsewhere (the tests' own).
# --list: print the selection and what was excluded, build and run nothing.
# --self-check: runs this script on a small made-up samples tree built from our own
#   tests/cuda programs and fixtures this script writes (no NVIDIA code), and checks that each
#   is classified as it must be (the runner's own test; tests/tests/cuda_samples.rs runs it).
#
# The selection (Samples/0_Introduction, 2_Concepts_and_Techniques, 3_CUDA_Features,
# 6_Performance; samples that need the CUDA runtime/driver API alone) is decided by these
# rules, checked in this order; the first that matches excludes the sample and is printed:
#   1. its CMakeLists.txt finds a package other than CUDAToolkit (OpenGL, GLUT, EGL, Vulkan,
#      MPI, OpenMP...): interop or a library beyond the CUDA runtime;
#   2. it links a CUDA:: target other than cudart, cudart_static, cuda_driver and cudadevrt
#      (cuBLAS, cuFFT, cuRAND, cuSPARSE, cuSOLVER, NPP, nvJPEG, NVRTC, nvJitLink...);
#   3. one of its sources includes a header of graphics interop (GL, EGL, Vulkan, Direct3D),
#      of such a library (cublas, cufft, curand, cusparse, cusolver, npp, nvjpeg, nvrtc,
#      nvJitLink, nvml), of MPI or OpenMP, or Common/helper_multiprocess.h (IPC);
#   4. its name says P2P, IPC, MultiGPU or CrossGPU, or its README's key concepts name
#      Multi-GPU, Peer to Peer or InterProcess Communication (samples that only look for peers
#      and run on one device, as vectorAddMMAP, stay);
#   5. its README's lowest supported SM is above 7.5: the device is a single sm_75 (Turing),
#      which cannot run it either.
# Each selected sample is built with the corpus's nvcc (qemu-scripts/cuda-corpus.sh installs
# it) at nvcc's default architecture, from the sources of its CMakeLists.txt's add_executable,
# with -std=c++17 --extended-lambda -lineinfo, -I Common/ and the sample's own include
# directories; CUDA::cuda_driver links our libcuda (-lcuda), dl/pthread/rt as named; the fatbin
# or PTX a driver-API sample loads (its CMakeLists' CUDA_FATBIN_FILE / CUDA_PTX_FILE custom
# command) is built beside it. CMake's CUDA_SEPARABLE_COMPILATION is followed only for the
# dynamic-parallelism samples (README dependency CDP, with -rdc=true -lcudadevrt): a
# device-linked image holds machine code only, no PTX, and the executor runs PTX. Builds are
# cached by content in $VGPU_CACHE/cuda-samples (default ~/.cache/vgpu/cuda-samples): a sample
# is rebuilt only when its sources, Common/, the command or the toolchain changed. Builds run
# one at a time under nice.
# Each sample runs in a copy of its directory's layout (links to its files and data/, with
# Common/ beside, as the samples' file search expects), with our libcuda.so.1 first on
# LD_LIBRARY_PATH and VGPU_CUDA_SOCKET naming the private vgpu-cuda-host. Classified as
#   pass: exit 0, and no failure line ("FAILED", "Test failed", "Result = FAIL") printed;
#   waived: exit 2 (the samples' EXIT_WAIVED), with the sample's reason line;
#   fail: otherwise, with a reason: the first cudaError*/CUDA_ERROR_* name printed, else the
#     last error line, the signal of a crash, or "exit 0 but ..." for a printed failure;
#   timeout: still running after --timeout seconds; build-fail: the first compiler error.
# VGPU_CUDA_TRACE=1 in the environment is passed on: each sample's log then names every entry
# point called and what it returned (logs in the cache's run/ directory).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The runner is the Python program below (bash never parses it; its children read no stdin).
exec python3 - "$@" <<'PY'
import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.getcwd()
CACHE = os.environ.get("VGPU_CACHE", os.path.expanduser("~/.cache/vgpu"))
NVCC_DIR = os.path.join(CACHE, "cuda", "nvidia", "cu13", "bin")
TOOLCHAIN_STAMP = os.path.join(CACHE, "cuda", "version")
CATEGORIES = ["0_Introduction", "2_Concepts_and_Techniques", "3_CUDA_Features", "6_Performance"]
# The device the samples see: a single sm_75 (rule 5).
DEVICE_SM = (7, 5)
# CUDA:: targets that are the runtime or the driver API (rule 2).
RUNTIME_TARGETS = {"cudart", "cudart_static", "cuda_driver", "cudadevrt"}
# Rule 3: headers and what including them means.
EXCLUDED_HEADERS = [
    (re.compile(r"^(GL/|GLES|EGL/|KHR/|vulkan|d3d|dxgi|cuda_gl_interop|cudaGL|cuda_egl_interop"
                r"|cudaEGL|cuda_d3d|cuda_vdpau|X11/)"), "graphics interop"),
    (re.compile(r"^(cublas|cufft|curand|cusparse|cusolver|npp|nvjpeg|nvrtc|nvJitLink|nvml"
                r"|cudla|nvsci)", re.I), "a math/media/JIT library"),
    (re.compile(r"^mpi\.h$"), "MPI"),
    (re.compile(r"^omp\.h$"), "OpenMP"),
    (re.compile(r"(^|/)helper_multiprocess\.h$"), "multi-process IPC"),
]
# Rule 4.
MULTI_DEVICE_NAME = re.compile(r"P2P|IPC|MultiGPU|CrossGPU")
EXCLUDED_CONCEPTS = ["Multi-GPU", "Peer to Peer", "InterProcess Communication"]
SOURCE_EXT = (".cu", ".cuh", ".cpp", ".c", ".h", ".hpp", ".cc")
# What a sample prints when it checked its results and found them wrong (a pass needs none).
# Case matters: simpleAssert prints "Device assert failed as expected" when it passes.
FAILURE_LINE = re.compile(r"\bFAILED\b|Test failed|Result = FAIL")
CUDA_ERROR_NAME = re.compile(r"\b(cudaError\w+|CUDA_ERROR_\w+)\b")
# The samples' EXIT_WAIVED.
EXIT_WAIVED = 2
DEFAULT_TIMEOUT_S = 120
# How long a sample gets after SIGTERM at its timeout before SIGKILL.
KILL_GRACE_S = 5
# How long vgpu-cuda-host gets to create its socket.
HOST_START_S = 20
# The budget (MiB) vgpu-cuda-host gets when it has a flag for one: the largest samples
# allocate a few hundred MiB of device memory (and pinned buffers as big) at once.
HOST_BUDGET_MIB = 4096
# The per-request time vgpu-cuda-host gets when it has a flag for it: long kernels of the
# samples run for minutes in the interpreter; the sample's own timeout bounds the run.
HOST_REQUEST_TIME_S = 600
# How many characters of a reason the table shows (the JSON has the whole line).
REASON_WIDTH = 90


def say(msg):
    print(msg, flush=True)


def fail_precondition(msg):
    print(f"cuda-samples: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def strip_cmake_comments(text):
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def cmake_calls(text, command):
    """The argument lists of each `command(...)` in CMake text (comments removed)."""
    out = []
    for m in re.finditer(r"\b" + command + r"\s*\(([^)]*)\)", strip_cmake_comments(text), re.I):
        out.append(m.group(1).split())
    return out


def source_files(sample_dir):
    for root, _, files in os.walk(sample_dir):
        for f in sorted(files):
            if f.endswith(SOURCE_EXT):
                yield os.path.join(root, f)


def readme_section(readme, title):
    m = re.search(r"^##\s*" + re.escape(title) + r".*?$(.*?)(?=^##\s|\Z)", readme, re.M | re.S)
    return m.group(1) if m else ""


def min_sm(readme):
    sms = re.findall(r"SM (\d+)\.(\d+)", readme_section(readme, "Supported SM Architectures"))
    return min(((int(a), int(b)) for a, b in sms), default=None)


def exclusion(sample_dir):
    """Why a sample is not in the selection (rules 1-5 of the header), or None."""
    cmake = read(os.path.join(sample_dir, "CMakeLists.txt"))
    for args in cmake_calls(cmake, "find_package"):
        if args and args[0] != "CUDAToolkit":
            return f"rule 1: CMakeLists finds package {args[0]}"
    for target in re.findall(r"CUDA::(\w+)", strip_cmake_comments(cmake)):
        if target not in RUNTIME_TARGETS:
            return f"rule 2: links CUDA::{target}"
    for path in source_files(sample_dir):
        text = read(path)
        for header in re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', text, re.M):
            for pattern, what in EXCLUDED_HEADERS:
                if pattern.search(header):
                    return f"rule 3: {os.path.basename(path)} includes <{header}> ({what})"
    readme_path = os.path.join(sample_dir, "README.md")
    readme = read(readme_path) if os.path.exists(readme_path) else ""
    m = MULTI_DEVICE_NAME.search(os.path.basename(sample_dir))
    if m:
        return f"rule 4: the name says {m.group(0)}"
    concepts = readme_section(readme, "Key Concepts")
    for concept in EXCLUDED_CONCEPTS:
        if concept.lower() in concepts.lower():
            return f"rule 4: README key concept {concept}"
    sm = min_sm(readme)
    if sm is not None and sm > DEVICE_SM:
        return f"rule 5: needs SM {sm[0]}.{sm[1]} (the device is sm_{DEVICE_SM[0]}{DEVICE_SM[1]})"
    return None


class Sample:
    def __init__(self, category, name, directory, samples_root):
        self.category = category
        self.name = name
        self.dir = directory
        self.root = samples_root
        self.result = None
        self.reason = ""
        self.seconds = 0.0

    def plan(self):
        """The nvcc commands that build the sample (relative output names), from its CMakeLists."""
        cmake = read(os.path.join(self.dir, "CMakeLists.txt"))
        execs = cmake_calls(cmake, "add_executable")
        if not execs:
            raise ValueError("no add_executable in CMakeLists.txt")
        target, sources = execs[0][0], execs[0][1:]
        self.target = target
        flags = ["-std=c++17", "--extended-lambda", "-lineinfo", "-Wno-deprecated-gpu-targets",
                 "-I" + os.path.join(self.root, "Common"), "-I" + self.dir]
        for call in cmake_calls(cmake, "target_include_directories") + cmake_calls(
                cmake, "include_directories"):
            for arg in call:
                m = re.fullmatch(r"\$\{CMAKE_CURRENT_SOURCE_DIR\}(/.*)?", arg)
                if m and m.group(1):
                    flags.append("-I" + os.path.join(self.dir, m.group(1).lstrip("/")))
        readme_path = os.path.join(self.dir, "README.md")
        readme = read(readme_path) if os.path.exists(readme_path) else ""
        deps = readme_section(readme, "Dependencies needed to build/run")
        cdp = re.search(r"\[CDP\]", deps) is not None
        if cdp:
            flags.append("-rdc=true")
        libs = []
        for call in cmake_calls(cmake, "target_link_libraries"):
            for arg in call[1:]:
                if arg == "CUDA::cuda_driver":
                    libs.append("-lcuda")
                elif arg in ("dl", "pthread", "rt"):
                    libs.append("-l" + arg)
        if cdp:
            libs.append("-lcudadevrt")
        steps = []
        kernel = re.search(r'set\(CUDA_KERNEL_SOURCE\s+"\$\{CMAKE_CURRENT_SOURCE_DIR\}/([^"]+)"\)', cmake)
        for kind, option in (("FATBIN", "-fatbin"), ("PTX", "-ptx")):
            out = re.search(r'set\(CUDA_' + kind + r'_FILE\s+"\$\{CMAKE_CURRENT_BINARY_DIR\}/([^"]+)"\)', cmake)
            if out and kernel:
                steps.append((out.group(1), ["-Wno-deprecated-gpu-targets",
                                             "-I" + os.path.join(self.root, "Common"), option,
                                             os.path.join(self.dir, kernel.group(1))]))
        srcs = [os.path.normpath(os.path.join(self.dir, s)) for s in sources]
        for s in srcs:
            if not os.path.exists(s):
                raise ValueError(f"source {s} of add_executable not found")
        steps.append((target, flags + srcs + libs))
        self.steps = steps
        self.inputs = sorted(set(source_files(self.dir)) | set(srcs))


def find_samples(root):
    out = []
    for category in CATEGORIES:
        cat_dir = os.path.join(root, "Samples", category)
        if not os.path.isdir(cat_dir):
            continue
        for name in sorted(os.listdir(cat_dir)):
            d = os.path.join(cat_dir, name)
            if os.path.isfile(os.path.join(d, "CMakeLists.txt")):
                out.append(Sample(category, name, d, root))
    return out


def tail_line(text, pattern=None):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    if pattern is not None:
        lines = [l for l in lines if pattern.search(l)]
    return lines[-1] if lines else ""


def build(sample, env, store, libdir, toolchain, common_key):
    """Builds `sample` into store/<name>/ unless its cached build is current; returns None or
    the build-fail reason."""
    out_dir = os.path.join(store, "build", sample.name)
    key_path = os.path.join(out_dir, ".key")
    h = hashlib.sha256()
    h.update(toolchain.encode())
    h.update(common_key.encode())
    for out, args in sample.steps:
        h.update(("\0".join([out, *args]) + "\n").encode())
    for path in sample.inputs:
        h.update(path.encode())
        with open(path, "rb") as f:
            h.update(f.read())
    key = h.hexdigest()
    if os.path.exists(key_path) and read(key_path) == key and all(
            os.path.exists(os.path.join(out_dir, out)) for out, _ in sample.steps):
        return None
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    log = os.path.join(out_dir, "build.log")
    started = time.monotonic()
    say(f"  building {sample.name} ({len(sample.steps)} step(s))")
    for out, args in sample.steps:
        link = ["-L" + libdir] if "-lcuda" in args else []
        cmd = ["nice", "-n", "10", "nvcc", "-o", os.path.join(out_dir, out), *args, *link]
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            r = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, cwd=out_dir)
        if r.returncode != 0:
            text = read(log)
            errors = [l.strip() for l in text.splitlines() if re.search(r"\berror\b", l)]
            return errors[0] if errors else f"nvcc exited {r.returncode}"
    with open(key_path, "w") as f:
        f.write(key)
    say(f"    done in {time.monotonic() - started:.0f} s")
    return None


def run_tree(sample, store):
    """The directory the sample runs in: links to its files, its built outputs, and Common/ at
    the depth the samples' file search expects (Samples/<category>/<name>/../../../Common)."""
    tree = os.path.join(store, "tree")
    run_dir = os.path.join(tree, "Samples", sample.category, sample.name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    common = os.path.join(tree, "Common")
    if os.path.islink(common) or os.path.exists(common):
        os.remove(common)
    os.symlink(os.path.join(sample.root, "Common"), common)
    for entry in os.listdir(sample.dir):
        os.symlink(os.path.join(sample.dir, entry), os.path.join(run_dir, entry))
    for out, _ in sample.steps:
        dst = os.path.join(run_dir, out)
        if os.path.lexists(dst):
            os.remove(dst)
        os.symlink(os.path.join(store, "build", sample.name, out), dst)
    return run_dir


def classify(rc, output, timed_out):
    if timed_out:
        return "timeout", tail_line(output)
    if rc == 0:
        bad = tail_line(output, FAILURE_LINE)
        if bad:
            return "fail", f"exit 0 but: {bad}"
        return "pass", tail_line(output)
    if rc == EXIT_WAIVED:
        line = tail_line(output, re.compile(r"waiv|not support|requires|skip|unsupported", re.I))
        return "waived", line or tail_line(output)
    if rc < 0 or rc > 128:
        sig = -rc if rc < 0 else rc - 128
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return "fail", f"killed by {name}: {tail_line(output)}"
    m = CUDA_ERROR_NAME.search(output)
    if m:
        line = next(l.strip() for l in output.splitlines() if m.group(1) in l)
        return "fail", f"{m.group(1)}: {line}"
    line = tail_line(output, re.compile(r"error|fail|undefined symbol|abort", re.I))
    return "fail", f"exit {rc}: {line or tail_line(output)}"


def run_sample(sample, run_dir, env, timeout, log_path):
    started = time.monotonic()
    with open(log_path, "w") as log:
        p = subprocess.Popen(["./" + sample.target], cwd=run_dir, env=env, stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        timed_out = False
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGTERM)
            try:
                rc = p.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
    seconds = time.monotonic() - started
    result, reason = classify(rc, read(log_path), timed_out)
    return result, reason, seconds


def host_flags(host):
    """The flags vgpu-cuda-host is given when its --help names them (older builds lack them)."""
    help_text = subprocess.run([host, "--help"], capture_output=True, text=True).stdout
    flags = []
    # Values as the flag's value name asks: seconds as a number or a duration with its unit; a
    # budget in bytes, in MiB, or a size with its unit.
    m = re.search(r"--request-time[ =]<(\w+)>", help_text)
    if m:
        unit = "s" if "DURATION" in m.group(1).upper() else ""
        flags += ["--request-time", f"{HOST_REQUEST_TIME_S}{unit}"]
    m = re.search(r"(--memory-budget|--budget)[ =]<(\w+)>", help_text)
    if m:
        name = m.group(2).upper()
        value = (str(HOST_BUDGET_MIB << 20) if "BYTES" in name
                 else str(HOST_BUDGET_MIB) if "MIB" in name else f"{HOST_BUDGET_MIB}MiB")
        flags += [m.group(1), value]
    return flags


def start_host(host, sock, log_path):
    flags = host_flags(host)
    say(f"starting {os.path.basename(host)} {' '.join(flags)} on {sock}")
    log = open(log_path, "w")
    p = subprocess.Popen([host, "--socket", sock, *flags], stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + HOST_START_S
    while not os.path.exists(sock):
        if p.poll() is not None:
            fail_precondition(f"vgpu-cuda-host exited {p.returncode}: {read(log_path).strip()}")
        if time.monotonic() > deadline:
            p.kill()
            fail_precondition(f"vgpu-cuda-host made no socket in {HOST_START_S} s")
        time.sleep(0.1)
    return p


def print_table(samples):
    width = max([len(s.name) for s in samples] + [6])
    say(f"\n{'sample':<{width}}  {'result':<10}  {'s':>6}  reason")
    for s in samples:
        reason = s.reason if len(s.reason) <= REASON_WIDTH else s.reason[:REASON_WIDTH - 3] + "..."
        say(f"{s.name:<{width}}  {s.result:<10}  {s.seconds:6.1f}  {reason}")
    counts = {}
    for s in samples:
        counts[s.result] = counts.get(s.result, 0) + 1
    say("\n" + ", ".join(f"{n} {r}" for r, n in sorted(counts.items())) + f" of {len(samples)}")


def main(argv):
    ap = argparse.ArgumentParser(prog="qemu-scripts/cuda-samples.sh")
    ap.add_argument("--samples")
    ap.add_argument("--guest", action="store_true")
    ap.add_argument("--only", nargs="+", default=[])
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    ap.add_argument("--json")
    ap.add_argument("--profile", default="debug")
    ap.add_argument("--lib")
    ap.add_argument("--host")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--self-check", action="store_true")
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.self_check:
        return self_check(argv)
    if not args.samples:
        ap.error("--samples DIR is required (a local checkout of NVIDIA's cuda-samples)")
    root = os.path.abspath(args.samples)
    if not os.path.isdir(os.path.join(root, "Samples")) or not os.path.isdir(os.path.join(root, "Common")):
        fail_precondition(f"{root} is not a cuda-samples checkout (no Samples/ and Common/)")
    store = os.path.abspath(args.store or os.path.join(CACHE, "cuda-samples"))

    samples = find_samples(root)
    selected = []
    say(f"selection from {root}:")
    for s in samples:
        why = exclusion(s.dir)
        if why:
            say(f"  excluded {s.category}/{s.name}: {why}")
        else:
            selected.append(s)
    say(f"{len(selected)} selected of {len(samples)} in {', '.join(CATEGORIES)}")
    if args.only:
        unknown = set(args.only) - {s.name for s in selected}
        if unknown:
            fail_precondition(f"--only: not in the selection: {' '.join(sorted(unknown))}")
        selected = [s for s in selected if s.name in args.only]
    if args.list:
        for s in selected:
            say(f"  {s.category}/{s.name}")
        return 0

    nvcc = os.path.join(NVCC_DIR, "nvcc")
    if not os.access(nvcc, os.X_OK):
        fail_precondition(f"no nvcc at {nvcc}: run qemu-scripts/cuda-corpus.sh first")
    toolchain = read(TOOLCHAIN_STAMP).strip() if os.path.exists(TOOLCHAIN_STAMP) else ""
    if "cccl" not in toolchain:
        fail_precondition("the corpus toolchain lacks the header-only wheels (CCCL, profiler API, "
                          "NVTX): run qemu-scripts/cuda-corpus.sh to upgrade it")
    lib = os.path.abspath(args.lib or os.path.join(REPO, "target", args.profile, "libcuda.so"))
    host = os.path.abspath(args.host or os.path.join(REPO, "target", args.profile, "vgpu-cuda-host"))
    for path, what in ((lib, "vgpu-libcuda"), (host, "mdev-backend")):
        if not os.path.exists(path):
            fail_precondition(f"{path} is missing: cargo build -p {what}"
                              + (" --release" if args.profile == "release" else ""))

    run_vm = os.path.join(REPO, "target", args.profile, "vgpu-run-vm")
    if args.guest:
        for path in (run_vm, os.path.join(REPO, "target", args.profile, "vgpu-server")):
            if not os.path.exists(path):
                fail_precondition(f"{path} is missing: cargo build -p vgpu-tests -p vgpu-server"
                                  + (" --release" if args.profile == "release" else ""))
        image = os.environ.get("VGPU_GUEST_DIR", os.path.join(CACHE, "guest"))
        if not os.path.exists(os.path.join(image, "rootfs.ext4")):
            fail_precondition(f"no guest image in {image}: run qemu-scripts/build-guest-image.sh")

    os.makedirs(store, exist_ok=True)
    work = tempfile.mkdtemp(prefix="cuda-samples.")
    libdir = os.path.join(work, "lib")
    os.makedirs(libdir)
    # The soname for the samples' loader, the linker's name for -lcuda.
    for name in ("libcuda.so.1", "libcuda.so"):
        os.symlink(lib, os.path.join(libdir, name))
    build_env = dict(os.environ, PATH=NVCC_DIR + os.pathsep + os.environ["PATH"])
    common = hashlib.sha256()
    for path in sorted(source_files(os.path.join(root, "Common"))):
        with open(path, "rb") as f:
            common.update(f.read())
    common_key = common.hexdigest()

    say(f"building {len(selected)} samples in {store} (cached ones are skipped)")
    runnable = []
    for i, s in enumerate(selected, 1):
        say(f"[{i}/{len(selected)}] {s.name}")
        try:
            s.plan()
            why = build(s, build_env, store, libdir, toolchain, common_key)
        except (ValueError, OSError) as e:
            why = str(e)
        if why:
            s.result, s.reason = "build-fail", why
            say(f"    build failed: {why}")
        else:
            runnable.append(s)

    logs = os.path.join(store, "guest-run" if args.guest else "run")
    os.makedirs(logs, exist_ok=True)
    if args.guest:
        try:
            run_in_guest(runnable, store, work, lib, run_vm, args.timeout, logs)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return report(selected, logs, store, args.json)
    sock = os.path.join(work, "cuda.sock")
    host_proc = start_host(host, sock, os.path.join(store, "vgpu-cuda-host.log"))
    run_env = dict(os.environ, VGPU_CUDA_SOCKET=sock,
                   LD_LIBRARY_PATH=libdir + (os.pathsep + os.environ["LD_LIBRARY_PATH"]
                                             if os.environ.get("LD_LIBRARY_PATH") else ""))
    try:
        for i, s in enumerate(runnable, 1):
            say(f"[{i}/{len(runnable)}] running {s.name}")
            run_dir = run_tree(s, store)
            s.result, s.reason, s.seconds = run_sample(
                s, run_dir, run_env, args.timeout, os.path.join(logs, s.name + ".log"))
            say(f"    {s.result} in {s.seconds:.1f} s: {s.reason}")
    finally:
        host_proc.terminate()
        try:
            host_proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            host_proc.kill()
            host_proc.wait()
        shutil.rmtree(work, ignore_errors=True)

    return report(selected, logs, store, args.json)


def report(selected, logs, store, json_path):
    print_table(selected)
    say(f"logs: {logs}/<sample>.log, {store}/build/<sample>/build.log")
    if json_path:
        with open(json_path, "w") as f:
            json.dump([{"name": s.name, "category": s.category, "result": s.result,
                        "reason": s.reason, "seconds": round(s.seconds, 1)} for s in selected],
                      f, indent=1)
            f.write("\n")
    return 0


# The guest's markers around each sample's output: start NAME, end NAME RC SECONDS.
GUEST_BEGIN = "@@cuda-samples begin"
GUEST_END = "@@cuda-samples end"
# The job shell's own notice of a sample killed by a signal ("/run/job.sh: line 3: 42 Aborted
# timeout ..."): not the sample's output.
JOB_SHELL_NOTICE = re.compile(r"^\S+: line \d+: +\d+ [A-Z][a-z]+")
# Where the guest mounts the samples' disk.
GUEST_DIR = "/tmp/work/samples"
# Time for the guest to boot and power off, besides the samples' own timeouts (TCG boots in
# about a minute on a loaded 2-core host).
GUEST_OVERHEAD_S = 300


def run_in_guest(runnable, store, work, lib, run_vm, timeout, logs):
    """Runs `runnable` in one guest: a disk of their run trees (links resolved), Common/data and
    our libcuda.so.1; a job that runs each with `timeout` and prints its output between markers."""
    root = os.path.join(work, "disk")
    os.makedirs(os.path.join(root, "Common"))
    common_data = os.path.join(runnable[0].root, "Common", "data") if runnable else None
    if common_data and os.path.isdir(common_data):
        shutil.copytree(common_data, os.path.join(root, "Common", "data"))
    shutil.copy(lib, os.path.join(root, "libcuda.so.1"))
    subprocess.run(["strip", os.path.join(root, "libcuda.so.1")], check=True)
    job = [f"mkdir -p {GUEST_DIR} && mount -o ro /dev/vdb {GUEST_DIR} || exit 1",
           f"export LD_LIBRARY_PATH={GUEST_DIR}"]
    for s in runnable:
        rel = os.path.join("Samples", s.category, s.name)
        shutil.copytree(run_tree(s, store), os.path.join(root, rel), symlinks=False)
        job.append(f"cd {GUEST_DIR}/{rel} && echo '{GUEST_BEGIN} {s.name}' && "
                   f"t0=$(date +%s%N) && timeout -k {KILL_GRACE_S} {timeout:g} ./{s.target} 2>&1; "
                   f"rc=$?; echo; echo \"{GUEST_END} {s.name} $rc $(( ($(date +%s%N) - t0) / 1000000 ))\"")
    job.append("exit 0")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    image = os.path.join(work, "samples.ext4")
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", root, image, f"{(size >> 20) * 2 + 32}M"],
                   check=True, stdout=subprocess.DEVNULL)
    job_file = os.path.join(work, "job.sh")
    with open(job_file, "w") as f:
        f.write("\n".join(job) + "\n")
    limit = GUEST_OVERHEAD_S + len(runnable) * (timeout + KILL_GRACE_S)
    say(f"booting the guest for {len(runnable)} samples (at most {limit:g} s)")
    started = time.monotonic()
    # The vGPU's executor gets the host path's request time and budget, so a sample is cut by
    # the same bounds in the guest as on the host.
    server = [f"--server-arg=--compute-request-time={HOST_REQUEST_TIME_S}",
              f"--server-arg=--resource-memory-mb={HOST_BUDGET_MIB}"]
    p = subprocess.run([run_vm, "--job-file", job_file, "--timeout", f"{limit:g}", *server,
                        f"--qemu-arg=-drive", f"--qemu-arg=file={image},format=raw,if=virtio,readonly=on"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                       text=True, errors="replace")
    with open(os.path.join(logs, "vgpu-run-vm.log"), "w") as f:
        f.write(p.stdout)
    say(f"the guest exited {p.returncode} after {time.monotonic() - started:.0f} s")
    outputs = {}
    current = None
    for line in p.stdout.splitlines():
        if line.startswith(GUEST_BEGIN + " "):
            current = line.split()[-1]
            outputs[current] = []
        elif line.startswith(GUEST_END + " ") and current is not None:
            parts = line.split()
            sample = next(x for x in runnable if x.name == current)
            rc, seconds = int(parts[-2]), int(parts[-1]) / 1000
            text = "\n".join(outputs[current])
            with open(os.path.join(logs, current + ".log"), "w") as f:
                f.write(text + "\n")
            # timeout(1) answers 124 when it stopped the sample, 137 when it had to kill it.
            timed_out = rc in (124, 137) and seconds >= timeout
            sample.result, sample.reason = classify(rc, text, timed_out)
            sample.seconds = seconds
            current = None
        elif current is not None and not JOB_SHELL_NOTICE.match(line):
            outputs[current].append(line)
    for s in runnable:
        if s.result is None:
            s.result = "fail"
            s.reason = f"no result from the guest (vgpu-run-vm exited {p.returncode}; see its log)"


# The made-up samples of --self-check: (name, CMakeLists extra, source or a tests/cuda
# program to copy, expected result or None when it must be excluded, what the reason must hold).
SELF_CHECK_MAIN = "int main() {{ {} }}\n"
SELF_CHECK = [
    ("passer", "", "tests/cuda/vector_add.cu", "pass", "PASS"),
    ("waiver", "", SELF_CHECK_MAIN.format(
        'printf("Waiving: this device lacks the feature\\n"); return 2;'), "waived",
     "Waiving: this device lacks the feature"),
    ("printsFailed", "", SELF_CHECK_MAIN.format('printf("Test failed!\\n"); return 0;'),
     "fail", "exit 0 but: Test failed!"),
    ("cudaErrorPrinter", "", SELF_CHECK_MAIN.format(
        'printf("CUDA error at x.cu:1 code=1(cudaErrorInvalidValue)\\n"); return 1;'), "fail",
     "cudaErrorInvalidValue"),
    ("crasher", "", SELF_CHECK_MAIN.format('fflush(stdout); raise(SIGSEGV); return 0;'), "fail",
     "killed by SIGSEGV"),
    ("sleeper", "", SELF_CHECK_MAIN.format('printf("working\\n"); fflush(stdout); sleep(60); return 0;'),
     "timeout", "working"),
    ("brokenBuild", "", "int main() { return undeclared_name; }\n", "build-fail",
     "error: identifier \"undeclared_name\" is undefined"),
    ("withGL", "find_package(OpenGL)\n", SELF_CHECK_MAIN.format("return 0;"), None,
     "rule 1: CMakeLists finds package OpenGL"),
    ("withCuBLAS", "target_link_libraries(withCuBLAS PUBLIC CUDA::cublas)\n",
     SELF_CHECK_MAIN.format("return 0;"), None, "rule 2: links CUDA::cublas"),
    ("simpleP2P", "", SELF_CHECK_MAIN.format("return 0;"), None, "rule 4: the name says P2P"),
]
# --self-check's per-sample timeout: the sleeper must reach it, the others finish in seconds.
SELF_CHECK_TIMEOUT_S = 20


def self_check(argv):
    """Runs main() on a made-up tree of SELF_CHECK samples and checks every classification."""
    passed_on = [a for a in argv if a != "--self-check"]
    tmp = tempfile.mkdtemp(prefix="cuda-samples-self-check.")
    try:
        os.makedirs(os.path.join(tmp, "Common"))
        cat = os.path.join(tmp, "Samples", CATEGORIES[0])
        for name, extra, source, _, _ in SELF_CHECK:
            d = os.path.join(cat, name)
            os.makedirs(d)
            with open(os.path.join(d, "CMakeLists.txt"), "w") as f:
                f.write(f"project({name} LANGUAGES C CXX CUDA)\nfind_package(CUDAToolkit REQUIRED)\n"
                        f"add_executable({name} {name}.cu)\n{extra}")
            if os.path.exists(os.path.join(REPO, source)):
                shutil.copy(os.path.join(REPO, source), os.path.join(d, name + ".cu"))
                shutil.copy(os.path.join(REPO, "tests/cuda/common.h"), d)
            else:
                with open(os.path.join(d, name + ".cu"), "w") as f:
                    f.write("#include <csignal>\n#include <cstdio>\n#include <unistd.h>\n" + source)
        out = os.path.join(tmp, "results.json")
        rc = main(["--samples", tmp, "--store", os.path.join(tmp, "store"), "--json", out,
                   "--timeout", str(SELF_CHECK_TIMEOUT_S), *passed_on])
        if rc != 0:
            fail_precondition(f"self-check: the run exited {rc}")
        with open(out) as f:
            got = {r["name"]: r for r in json.load(f)}
        wrong = []
        for name, _, _, result, reason in SELF_CHECK:
            if result is None:
                if name in got:
                    wrong.append(f"{name} was selected; it must be excluded ({reason})")
                continue
            r = got.get(name)
            if r is None:
                wrong.append(f"{name} is missing from the results")
            elif r["result"] != result or reason not in r["reason"]:
                wrong.append(f"{name}: {r['result']} ({r['reason']}), expected {result} ({reason})")
        if wrong:
            for w in wrong:
                say(f"self-check: WRONG {w}")
            return 1
        say(f"self-check: PASS, all {len(SELF_CHECK)} made-up samples classified as expected")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


sys.exit(main(sys.argv[1:]))
PY
