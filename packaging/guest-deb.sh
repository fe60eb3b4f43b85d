#!/usr/bin/env bash
# Builds the Debian package of vgpu's guest CUDA side, vgpu-guest-cuda_<version>_amd64.deb, for
# a user's own Debian guest (trixie; any with the glibc floor): our libcuda.so.1 (the CUDA
# driver API over the vGPU, guest-drivers/libcuda) in the multiarch library directory with its
# libcuda.so link, and the guest's vgpu-smi (built as vgpu-smi-guest) in /usr/bin. The package
# depends on the glibc these two need, measured here from their dynamic symbols (objdump -T:
# the highest GLIBC_x.y version they reference). README.md ("CUDA in your own guest") and
# docs/CUDA-GUEST.md describe it.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: packaging/guest-deb.sh [--bin-dir DIR] [--out DIR]

  --bin-dir DIR  take libcuda.so and vgpu-smi-guest from DIR instead of building them
                 (default: cargo build --release --locked -p vgpu-libcuda)
  --out DIR      where the package is written (default: the current directory)

Prints the package's path and the glibc floor it depends on.
EOF
}

PACKAGE=vgpu-guest-cuda
ARCH=amd64
# Debian's multiarch library directory for amd64.
LIBDIR=usr/lib/x86_64-linux-gnu
MAINTAINER="vgpu developers <vgpu@localhost>"

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin_dir=
out=.
while (($#)); do
    arg=$1
    shift
    case $arg in
    --bin-dir=* | --out=*)
        set -- "${arg%%=*}" "${arg#*=}" "$@"
        continue
        ;;
    --bin-dir | --out)
        (($#)) || { echo "guest-deb.sh: $arg needs a value" >&2; exit 2; }
        case $arg in
        --bin-dir) bin_dir=$1 ;;
        --out) out=$1 ;;
        esac
        shift
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    *)
        echo "guest-deb.sh: unknown argument '$arg'" >&2
        usage >&2
        exit 2
        ;;
    esac
done

die() {
    echo "guest-deb.sh: $*" >&2
    exit 1
}

for tool in dpkg-deb objdump strip md5sum; do
    command -v "$tool" >/dev/null ||
        die "$tool not found (Debian packages: dpkg for dpkg-deb, binutils for objdump and strip)"
done

# The workspace's version ([workspace.package] in Cargo.toml).
version=$(awk '/^\[/ { section = $0 } section == "[workspace.package]" && /^version *=/ {
    gsub(/[" ]/, "", $0); sub(/^version=/, "", $0); print; exit }' "$REPO/Cargo.toml")
[[ $version =~ ^[0-9][0-9A-Za-z.+~-]*$ ]] || die "no usable version in $REPO/Cargo.toml: '$version'"

if [[ -z $bin_dir ]]; then
    cargo build --manifest-path "$REPO/Cargo.toml" --release --locked -p vgpu-libcuda \
        --lib --bin vgpu-smi-guest >&2
    bin_dir=${CARGO_TARGET_DIR:-$REPO/target}/release
fi
lib=$bin_dir/libcuda.so
smi=$bin_dir/vgpu-smi-guest
[[ -f $lib ]] || die "$lib not found"
[[ -f $smi ]] || die "$smi not found"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/root
install -d "$root/DEBIAN" "$root/$LIBDIR" "$root/usr/bin" "$root/usr/share/doc/$PACKAGE"
# Stripped of debugging sections only: the dynamic symbols (the driver API) stay.
strip --strip-unneeded -o "$root/$LIBDIR/libcuda.so.1" "$lib"
chmod 0644 "$root/$LIBDIR/libcuda.so.1"
ln -s libcuda.so.1 "$root/$LIBDIR/libcuda.so"
strip --strip-unneeded -o "$root/usr/bin/vgpu-smi" "$smi"
chmod 0755 "$root/usr/bin/vgpu-smi"

# The glibc floor: the highest GLIBC_x.y symbol version either file references.
glibc_floor() {
    objdump -T "$1" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/^GLIBC_//' | sort -V | tail -n 1
}
lib_floor=$(glibc_floor "$root/$LIBDIR/libcuda.so.1")
smi_floor=$(glibc_floor "$root/usr/bin/vgpu-smi")
[[ -n $lib_floor && -n $smi_floor ]] || die "no GLIBC symbol versions found (not glibc binaries?)"
floor=$(printf '%s\n%s\n' "$lib_floor" "$smi_floor" | sort -V | tail -n 1)

cat >"$root/usr/share/doc/$PACKAGE/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: vgpu
Comment: The guest side of vgpu's CUDA remoting: libcuda.so.1 (guest-drivers/libcuda)
 and the guest's vgpu-smi. Built from the vgpu workspace, version $version.

Files: *
Copyright: vgpu developers
License: Apache-2.0
 Licensed under the Apache License, Version 2.0 (the "License"); you may not use
 these files except in compliance with the License. You may obtain a copy of the
 License at http://www.apache.org/licenses/LICENSE-2.0
 .
 On Debian systems, the full text of the Apache License, Version 2.0 can be found
 in the file /usr/share/common-licenses/Apache-2.0.
EOF
chmod 0644 "$root/usr/share/doc/$PACKAGE/copyright"

installed_kib=$(du -sk --apparent-size "$root/usr" | cut -f1)
cat >"$root/DEBIAN/control" <<EOF
Package: $PACKAGE
Version: $version
Architecture: $ARCH
Maintainer: $MAINTAINER
Installed-Size: $installed_kib
Depends: libc6 (>= $floor)
Conflicts: libcuda1
Replaces: libcuda1
Section: libs
Priority: optional
Description: CUDA driver API for guests of a vgpu virtual GPU
 libcuda.so.1 for virtual machines on a vgpu host: CUDA programs and GCC's
 nvptx offloading run unmodified, their modules, memory, copies and kernels
 forwarded to the host's compute backend through the vGPU's virtio-gpu device.
 Also vgpu-smi, which shows the device, the driver and CUDA versions, the VM's
 GPU memory and its GPU utilisation from inside the guest.
EOF
# ldconfig runs once the library is unpacked (as for any shared library package).
echo "activate-noawait ldconfig" >"$root/DEBIAN/triggers"
(cd "$root" && find usr -type f -print0 | sort -z | xargs -0 md5sum) >"$root/DEBIAN/md5sums"
chmod 0644 "$root/DEBIAN/control" "$root/DEBIAN/triggers" "$root/DEBIAN/md5sums"

mkdir -p "$out"
deb=$out/${PACKAGE}_${version}_${ARCH}.deb
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
echo "$deb"
echo "glibc floor: $floor (libcuda.so.1 $lib_floor, vgpu-smi $smi_floor)"
