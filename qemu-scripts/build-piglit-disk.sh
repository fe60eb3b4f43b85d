#!/usr/bin/env bash
# Builds the piglit disk: Debian's piglit (the GL conformance suite, pinned below) for the guest
# image's suite, on a read-only ext4 image the GL conformance comparison attaches as a second
# disk (tests/src/piglit.rs mounts it in the guest). The guest image stays as it is: piglit
# installs 2 GiB, nearly all of it generated shader tests this selection does not run.
#
# On the disk: piglit's bin/, lib/ and tests/ trees (without the generated tests, the Python
# framework and the OpenCL data), the generated shader tests the selection names, the two
# libraries piglit needs that the guest image lacks (libwaffle-1-0, libxcb-dri2-0) in deps/,
# and tests.json: one JSON object per line, {"name", "group", "argv"}, for each test that
# tests/piglit/selection.txt selects from piglit's quick_gl and quick_shader profiles, with
# the arguments piglit's own runner would give it (-auto, and -fbo where it runs concurrently).
#
# No root needed (mkfs.ext4 -d). Idempotent: the cache is rebuilt only when the pinned packages
# or the selection change.
#   qemu-scripts/build-piglit-disk.sh        -> ${VGPU_PIGLIT_DISK:-$CACHE/piglit}/piglit.ext4
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source qemu-scripts/progress.sh
source qemu-scripts/debian-mirror.sh
started=$SECONDS
cache=${VGPU_CACHE:-$HOME/.cache/vgpu}
out=${VGPU_PIGLIT_DISK:-$cache/piglit}
suite=trixie
# Pinned so every machine runs the same tests (the suite's version; the guest image's Mesa is
# the suite's too).
packages=(piglit=0.0~git20250409.af62c0dea-2 libwaffle-1-0=1.8.1-1 libxcb-dri2-0=1.17.0-2+b1)
selection=tests/piglit/selection.txt
stamp="${packages[*]} selection $(sha256sum "$selection" | cut -c1-16) layout 1"

log() { printf '[build-piglit-disk] %s\n' "$*"; }
die() { printf 'build-piglit-disk.sh: %s\n' "$*" >&2; exit 1; }

if [[ -e $out/stamp && $(cat "$out/stamp") == "$stamp" && -e $out/piglit.ext4 && -e $out/tests.json ]]; then
    log "piglit disk ready: $(wc -l <"$out/tests.json") tests ($out)"
    exit 0
fi
for tool in curl xz dpkg-deb tar python3 mkfs.ext4 sha256sum; do
    command -v "$tool" >/dev/null || die "$tool not found (Debian: curl xz-utils dpkg tar python3 e2fsprogs coreutils)"
done
mirror=$(debian_mirror)
[[ -n $mirror ]] || die "no Debian mirror found in /etc/apt sources; set VGPU_DEBIAN_MIRROR"
mkdir -p "$out/debs"
work=$(mktemp -d "$out/build.XXXXXX")
trap 'rm -rf "$work"' EXIT

log "step 1/4 ($(elapsed "$started")): the $suite package index"
index=$out/debs/Packages-$suite
if [[ ! -s $index || -n $(find "$index" -mmin +1440) ]]; then
    curl -fsSL --retry 3 -o "$work/Packages.xz" "$mirror/dists/$suite/main/binary-amd64/Packages.xz" ||
        die "could not fetch the $suite package index from $mirror"
    xz -dc "$work/Packages.xz" >"$index.new" && mv "$index.new" "$index"
fi

log "step 2/4 ($(elapsed "$started")): ${packages[*]}"
debs=()
for pv in "${packages[@]}"; do
    name=${pv%%=*} version=${pv#*=}
    # Filename and SHA256 of exactly this version in the index.
    read -r file sum < <(awk -v p="$name" -v v="$version" '
        /^Package: / { pkg = $2; ver = ""; fn = ""; sha = "" }
        /^Version: / { ver = $2 } /^Filename: / { fn = $2 } /^SHA256: / { sha = $2 }
        /^$/ { if (pkg == p && ver == v) { print fn, sha; exit } }' "$index") ||
        die "$name $version is not in $suite any more; update the pin in $0"
    deb=$out/debs/$(basename "$file")
    if [[ ! -e $deb ]] || ! echo "$sum  $deb" | sha256sum -c --quiet >/dev/null 2>&1; then
        log "    downloading $(basename "$file")"
        curl -fL --retry 3 --progress-bar -o "$deb.part" "$mirror/$file" || die "could not download $file"
        echo "$sum  $deb.part" | sha256sum -c --quiet || die "$file does not match the index's SHA256"
        mv "$deb.part" "$deb"
    fi
    debs+=("$deb")
done

log "step 3/4 ($(elapsed "$started")): unpacking and selecting"
root=$work/root
lib=usr/lib/x86_64-linux-gnu
mkdir -p "$root/deps" "$work/x"
dpkg-deb --fsys-tarfile "${debs[0]}" |
    tar -x -C "$work/x" --wildcards --exclude="./$lib/piglit/generated_tests/*" \
        --exclude="./$lib/piglit/framework/*" --exclude="./$lib/piglit/tests/cl/*" "./$lib/piglit/*"
mv "$work/x/$lib/piglit/"* "$root/"
for deb in "${debs[@]:1}"; do
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work/x" --wildcards "./$lib/*.so.*"
done
find "$work/x/$lib" -maxdepth 1 -name '*.so.*' -exec mv {} "$root/deps/" \;
python3 - "$root" "$selection" <<'PY'
import ast, gzip, json, sys, xml.etree.ElementTree as ET
root, selection = sys.argv[1], sys.argv[2]
rules = []
for line in open(selection):
    if line.strip() and not line.startswith("#"):
        group, profile, prefix = line.split(None, 2)
        rules.append((group, profile, prefix.strip()))
tests, generated = [], []
for profile in ("quick_gl", "quick_shader"):
    for test in ET.parse(gzip.open(f"{root}/tests/{profile}.xml.gz")).getroot():
        name = test.get("name")
        group = next((g for g, p, pre in rules if p == profile and name.startswith(pre)), None)
        if group is None:
            continue
        opts = {o.get("name"): o.get("value") for o in test.iter("option")}
        argv = ast.literal_eval(opts["command"])
        concurrent = opts.get("run_concurrent") == "True"
        if test.get("type") == "shader":
            argv = argv[:2] + ["-auto", "-fbo"]
            if argv[1].startswith("generated_tests/"):
                generated.append(argv[1])
        elif test.get("type") == "gl":
            argv = argv + (["-auto", "-fbo"] if concurrent else ["-auto"])
        else:
            continue
        tests.append({"name": name, "group": group, "argv": argv})
with open(f"{root}/tests.json", "w") as f:
    for t in tests:
        f.write(json.dumps(t) + "\n")
with open(f"{root}/../generated.txt", "w") as f:
    f.writelines(f"./usr/lib/x86_64-linux-gnu/piglit/{g}\n" for g in generated)
print(f"    {len(tests)} tests selected, {len(generated)} of them generated shader tests")
PY
if [[ -s $work/generated.txt ]]; then
    dpkg-deb --fsys-tarfile "${debs[0]}" | tar -x -C "$work/x" -T "$work/generated.txt"
    cp -r "$work/x/$lib/piglit/generated_tests" "$root/"
fi
rm -f "$root"/tests/*.xml.gz

log "step 4/4 ($(elapsed "$started")): ext4 image"
size_mib=$(($(du -sm "$root" | cut -f1) * 5 / 4 + 32))
rm -f "$work/piglit.ext4"
mkfs.ext4 -q -L piglit -d "$root" "$work/piglit.ext4" "${size_mib}M" >/dev/null || die "mkfs.ext4 -d failed"
mv "$work/piglit.ext4" "$out/piglit.ext4"
cp "$root/tests.json" "$out/tests.json"
echo "$stamp" >"$out/stamp"
log "done in $(elapsed "$started"): $(wc -l <"$out/tests.json") tests on a ${size_mib} MiB disk ($out)"
