#!/usr/bin/env bash
# Builds the Debian trixie test guest from Debian packages only, into
# ${VGPU_CACHE:-$HOME/.cache/vgpu}/guest:
#   rootfs.ext4   the root file system (virtio-blk, mounted read-only by the guest)
#   vmlinuz       the guest kernel (linux-image-amd64, 6.12)
#   initrd.img    its initramfs (MODULES=list: virtio, ext4, virtio_gpu/DRM, qemu_fw_cfg)
#   manifest.txt  kernel and Mesa versions, package count, sizes, vgpu-load's hash
# The image also holds /usr/local/bin/vgpu-load, the guest load tool (guest-drivers/src/bin/vgpu-load/),
# and /usr/local/bin/vgpu-agent, the guest end of the host-guest control channel (a virtio-serial
# port; guest-drivers/src/bin/vgpu-agent.rs), both built here as static binaries with cargo
# (target dir: $CACHE/vgpu-load-target), and CUDA: our
# guest driver libcuda.so.1 and the guest's vgpu-smi, installed with dpkg from the vgpu-guest-cuda
# package that packaging/guest-deb.sh builds (as a user installs it in their own guest),
# Debian's libgomp-plugin-nvptx1, and the CUDA corpus of qemu-scripts/cuda-corpus.sh in
# /usr/local/share/vgpu-cuda when it has been built (run that script first).
# The guest boots with init=/usr/local/sbin/vgpu-init (qemu-scripts/guest/vgpu-init), which runs
# one job and powers off; see tests/src/guest.rs and qemu-scripts/run-vm.sh.
#
# Recipe: debootstrap --variant=minbase, then the GL/KMS test packages with apt-get inside the
# chroot, docs/locales/unneeded kernel modules pruned, packed with `mkfs.ext4 -d` (no loop mount).
# Needs root (debootstrap, chroot); installs debootstrap with apt-get if missing.
#
# Idempotent: a finished image is recognised by its stamp (layout + a hash of this script, the init
# and vgpu-load's sources) and the script returns at once; change any of them and the next run
# rebuilds.
# Environment: VGPU_CACHE (cache root), VGPU_DEBIAN_MIRROR (archive URL; default: the mirror this
# host's apt sources use).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
CACHE=${VGPU_CACHE:-$HOME/.cache/vgpu}
OUT=$CACHE/guest
WORK=$CACHE/guest.partial
ROOT=$WORK/root
STAMP=$OUT/.vgpu-guest-complete
INIT_SRC=$HERE/guest/vgpu-init
# vgpu-load's sources, with the command-line crate it parses its arguments with: the image is
# rebuilt when they change (not for other crates' changes).
LOAD_SRC=("$REPO/guest-drivers/Cargo.toml" "$REPO/guest-drivers/src/bin/vgpu-load"
    "$REPO/guest-drivers/src/bin/vgpu-agent.rs" "$REPO/guest-drivers/src/control.rs"
    "$REPO/guest-drivers/src/virtgpu.rs" "$REPO/cli/Cargo.toml" "$REPO/cli/src")
LOAD_TARGET_DIR=$CACHE/vgpu-load-target
# The guest CUDA driver's sources (with the wire protocol it speaks) and the corpus: the image is
# rebuilt when they change.
CUDA_SRC=("$REPO/guest-drivers/libcuda/Cargo.toml" "$REPO/guest-drivers/libcuda/src"
    "$REPO/mdev-backend/src/compute/wire.rs" "$REPO/mdev-backend/src/compute/backend.rs"
    "$REPO/packaging/guest-deb.sh")
CORPUS=${VGPU_CUDA_CORPUS:-$CACHE/cuda-corpus}
LOAD_TRIPLE=x86_64-unknown-linux-gnu
SUITE=trixie
PACKAGES=(
    linux-image-amd64 initramfs-tools zstd kmod
    libgl1-mesa-dri libegl-mesa0 libgles2 libgbm1 libegl1 mesa-utils mesa-utils-bin
    glmark2-es2-drm kmscube pciutils stress-ng libgomp-plugin-nvptx1
    gstreamer1.0-tools gstreamer1.0-gl gstreamer1.0-plugins-base
)
# The single-mode EDID every benchmark boot loads with drm.edid_firmware=$EDID_NAME, so that all
# virtio-gpu devices (ours, QEMU's, vhost-user-gpu) offer exactly one mode: glmark2-es2-drm and
# kmscube take the largest mode a connector lists, and QEMU's own EDID lists up to 5120x2160.
EDID_NAME=edid/vgpu-1024x768.bin
INITRAMFS_MODULES=(virtio_pci virtio_blk virtio_console virtio_gpu drm drm_kms_helper ext4 qemu_fw_cfg)
# Kernel module trees no guest of ours needs (real hardware); pruning them halves the image.
PRUNE_MODULES=(
    drivers/gpu/drm/amd drivers/gpu/drm/nouveau drivers/gpu/drm/i915 drivers/gpu/drm/xe
    drivers/gpu/drm/radeon drivers/net/wireless drivers/net/ethernet drivers/media
    drivers/infiniband drivers/staging drivers/bluetooth drivers/iio drivers/isdn drivers/usb
    drivers/hid drivers/input/touchscreen drivers/scsi drivers/ata drivers/md drivers/mtd
    drivers/nfc drivers/platform/x86 drivers/hwmon drivers/thunderbolt sound net/wireless
    net/bluetooth net/mac80211 fs/btrfs fs/xfs fs/ocfs2 fs/nfs fs/nfsd fs/smb fs/ceph
)
# Bump when the layout of the output changes.
# 2: the benchmark EDID, GStreamer GL.
LAYOUT=2

log() { printf '[build-guest-image] %s\n' "$*" >&2; }
die() { printf '[build-guest-image] error: %s\n' "$*" >&2; exit 1; }

fingerprint() {
    printf 'layout %s\n' "$LAYOUT"
    {
        cat "${BASH_SOURCE[0]}" "$INIT_SRC"
        # Names and contents, so a renamed file changes the hash too.
        find "${LOAD_SRC[@]}" "${CUDA_SRC[@]}" -type f -print | LC_ALL=C sort | while read -r f; do
            printf '%s\n' "${f#"$REPO"/}"
            cat "$f"
        done
        [[ -d $CORPUS ]] && find "$CORPUS" -maxdepth 1 -type f -print0 | LC_ALL=C sort -z | xargs -0r sha256sum
    } | sha256sum | cut -d' ' -f1
}

[[ -f $INIT_SRC ]] || die "guest init $INIT_SRC is missing"
for src in "${LOAD_SRC[@]}" "${CUDA_SRC[@]}"; do [[ -e $src ]] || die "source $src is missing"; done
if [[ -f $STAMP && -f $OUT/rootfs.ext4 && -f $OUT/vmlinuz && -f $OUT/initrd.img &&
    $(head -n2 "$STAMP") == "$(fingerprint)" ]]; then
    log "guest image ready: $(sed -n 3p "$STAMP") ($OUT)"
    exit 0
fi

[[ $(id -u) == 0 ]] || die "building the guest image needs root (debootstrap, chroot); run it as root or with sudo"
for tool in apt-get dpkg chroot mountpoint; do
    command -v "$tool" >/dev/null || die "'$tool' not found: this script needs a Debian-based host"
done
command -v cargo >/dev/null ||
    die "cargo not found (needed to build vgpu-load); with sudo, keep your PATH: sudo env PATH=\"\$PATH\" $0"

source "$HERE/debian-mirror.sh"
MIRROR=$(debian_mirror)
[[ -n $MIRROR ]] || die "no Debian mirror found in /etc/apt sources; set VGPU_DEBIAN_MIRROR"

started=$SECONDS
mkdir -p "$CACHE"
LOG=$CACHE/guest-build.log
: >"$LOG"
log "building the $SUITE guest image in $OUT from $MIRROR (log: $LOG)"

# Runs a command with its output in the build log; on failure shows the log's tail and stops.
run_logged() {
    local what=$1
    shift
    if ! "$@" >>"$LOG" 2>&1; then
        tail -n 30 "$LOG" | sed 's/^/    /' >&2
        die "$what failed (full log: $LOG)"
    fi
}

# Progress of debootstrap and apt-get (apt_progress) goes to the build log as well.
source "$(dirname "${BASH_SOURCE[0]}")/progress.sh"
PROGRESS_LOG=$LOG

# The chroot's API file systems; only ours, found by path, and unmounted innermost first.
chroot_mounts() { awk -v root="$ROOT" '$2 == root || index($2, root "/") == 1 { print $2 }' /proc/mounts | sort -r; }
umount_chroot() {
    local m
    for m in $(chroot_mounts); do umount -l "$m" 2>/dev/null || true; done
}
trap umount_chroot EXIT

if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap with apt-get"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >>"$LOG" 2>&1; then
        run_logged "apt-get update" apt-get update -q
        run_logged "installing debootstrap" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
    fi
fi
command -v mkfs.ext4 >/dev/null || die "mkfs.ext4 not found; install e2fsprogs"
[[ -e /usr/share/debootstrap/scripts/$SUITE ]] ||
    die "this debootstrap ($(dpkg-query -W -f '${Version}' debootstrap)) does not know $SUITE; upgrade debootstrap"

# Writes a 128-byte EDID 1.3 block with one detailed timing, VESA DMT 1024x768 at 60 Hz (65 MHz;
# h 1024+24+136+160, v 768+3+6+29, both syncs negative), no established, standard or range-limit
# timings (so the kernel infers no other modes), monitor name "vgpu".
write_edid() {
    local -a b=(
        0x00 0xff 0xff 0xff 0xff 0xff 0xff 0x00 # header
        0x58 0xf0 0x01 0x00 0x00 0x00 0x00 0x00 # vendor "VGP", product 1, serial 0
        0x00 0x24 0x01 0x03                     # week -, 2026, EDID 1.3
        0x80 0x1b 0x14 0x78 0x0a                # digital, 27x20 cm, gamma 2.2, RGB, preferred timing
        0xee 0x91 0xa3 0x54 0x4c 0x99 0x26 0x0f 0x50 0x54 # chromaticity (sRGB)
        0x00 0x00 0x00                          # no established timings
        0x01 0x01 0x01 0x01 0x01 0x01 0x01 0x01 0x01 0x01 0x01 0x01 0x01 0x01 0x01 0x01
        # detailed timing: 65.00 MHz, 1024/320, 768/38, sync 24/136, 3/6, 270x203 mm, separate sync
        0x64 0x19 0x00 0x40 0x41 0x00 0x26 0x30 0x18 0x88 0x36 0x00 0x0e 0xcb 0x10 0x00 0x00 0x18
        0x00 0x00 0x00 0xfc 0x00 0x76 0x67 0x70 0x75 0x0a 0x20 0x20 0x20 0x20 0x20 0x20 0x20 0x20
        0x00 0x00 0x00 0x10 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00
        0x00 0x00 0x00 0x10 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00 0x00
        0x00                                    # no extension blocks
    )
    ((${#b[@]} == 127)) || die "EDID template has ${#b[@]} bytes, not 127"
    local sum=0 x
    for x in "${b[@]}"; do sum=$((sum + x)); done
    b+=($(((256 - sum % 256) % 256)))
    mkdir -p "$(dirname "$1")"
    printf "$(printf '\\x%02x' "${b[@]}")" >"$1"
}

umount_chroot
rm -rf "$WORK"
mkdir -p "$WORK"

log "step 1/6 ($(elapsed "$started")): building vgpu-load and vgpu-agent (static, $LOAD_TRIPLE) into $LOAD_TARGET_DIR"
t=$SECONDS
run_logged "building vgpu-load and vgpu-agent" env RUSTFLAGS="-C target-feature=+crt-static" \
    CARGO_TARGET_DIR="$LOAD_TARGET_DIR" cargo build --manifest-path "$REPO/Cargo.toml" --release \
    --locked --target "$LOAD_TRIPLE" -p vgpu-guest-drivers --bin vgpu-load --bin vgpu-agent
load_bin=$LOAD_TARGET_DIR/$LOAD_TRIPLE/release/vgpu-load
agent_bin=$LOAD_TARGET_DIR/$LOAD_TRIPLE/release/vgpu-agent
# A static binary has no program interpreter (checked where binutils is installed).
for bin in "$load_bin" "$agent_bin"; do
    if command -v readelf >/dev/null && LC_ALL=C readelf -l "$bin" | grep -q 'program interpreter'; then
        die "$bin is dynamically linked; it must be static for the guest"
    fi
done
load_sha=$(sha256sum "$load_bin" | cut -d' ' -f1)
log "    done in $((SECONDS - t)) s: $(du -k "$load_bin" | cut -f1) KiB, sha256 ${load_sha:0:16}"
log "    building the guest CUDA package (libcuda.so.1, vgpu-smi) into $LOAD_TARGET_DIR"
run_logged "building the guest CUDA package" env CARGO_TARGET_DIR="$LOAD_TARGET_DIR" \
    "$REPO/packaging/guest-deb.sh" --out "$WORK/deb"
cuda_deb=$(ls "$WORK"/deb/vgpu-guest-cuda_*_amd64.deb)

log "step 2/6 ($(elapsed "$started")): debootstrap --variant=minbase $SUITE"
t=$SECONDS
debootstrap --variant=minbase --components=main "$SUITE" "$ROOT" "$MIRROR" 2>&1 | apt_progress "    " ||
    { tail -n 30 "$LOG" | sed 's/^/    /' >&2; die "debootstrap failed (full log: $LOG)"; }
log "    done in $((SECONDS - t)) s"

log "step 3/6 ($(elapsed "$started")): configuring apt, dpkg path exclusions and initramfs (MODULES=list)"
cat >"$ROOT/etc/dpkg/dpkg.cfg.d/90-vgpu-nodoc" <<'CFG'
path-exclude=/usr/share/doc/*
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-exclude=/usr/share/lintian/*
path-exclude=/usr/share/bug/*
CFG
cat >"$ROOT/etc/apt/apt.conf.d/90-vgpu" <<'CFG'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
CFG
printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
chmod 755 "$ROOT/usr/sbin/policy-rc.d"
mkdir -p "$ROOT/etc/initramfs-tools/conf.d"
printf 'MODULES=list\nCOMPRESS=zstd\n' >"$ROOT/etc/initramfs-tools/conf.d/90-vgpu.conf"
printf '%s\n' "${INITRAMFS_MODULES[@]}" >>"$ROOT/etc/initramfs-tools/modules"
echo vgpu-guest >"$ROOT/etc/hostname"
# The benchmark EDID, in the root and (virtio_gpu probes from the initramfs) in the initramfs.
write_edid "$ROOT/usr/lib/firmware/$EDID_NAME"
mkdir -p "$ROOT/etc/initramfs-tools/hooks"
cat >"$ROOT/etc/initramfs-tools/hooks/vgpu-edid" <<HOOK
#!/bin/sh
[ "\$1" = prereqs ] && exit 0
. /usr/share/initramfs-tools/hook-functions
copy_file firmware /usr/lib/firmware/$EDID_NAME /usr/lib/firmware/$EDID_NAME
HOOK
chmod 755 "$ROOT/etc/initramfs-tools/hooks/vgpu-edid"
printf '/dev/vda / ext4 ro,noatime 0 1\n' >"$ROOT/etc/fstab"

log "step 4/6 ($(elapsed "$started")): installing ${#PACKAGES[@]} packages and their dependencies in the chroot"
t=$SECONDS
mount -t proc proc "$ROOT/proc"
mount -t sysfs sysfs "$ROOT/sys"
mount --bind /dev "$ROOT/dev"
mount --bind /dev/pts "$ROOT/dev/pts"
chroot_env=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 HOME=/root)
chroot "$ROOT" "${chroot_env[@]}" apt-get -q update 2>&1 | apt_progress "    "
chroot "$ROOT" "${chroot_env[@]}" apt-get -q -y install "${PACKAGES[@]}" 2>&1 | apt_progress "    " ||
    { tail -n 30 "$LOG" | sed 's/^/    /' >&2; die "apt-get install in the chroot failed (full log: $LOG)"; }
kver=$(basename "$(ls -d "$ROOT"/lib/modules/* | sort -V | tail -n1)")
[[ -f $ROOT/boot/vmlinuz-$kver && -f $ROOT/boot/initrd.img-$kver ]] ||
    die "the kernel or its initramfs was not installed (kernel $kver; see $LOG)"
initrd_list=$(chroot "$ROOT" lsinitramfs "/boot/initrd.img-$kver")
for module in virtio_gpu virtio_blk ext4 qemu_fw_cfg; do
    # Module files may use - for _ and are compressed (virtio-gpu.ko.xz).
    grep -Eq "/${module//_/[-_]}\.ko" <<<"$initrd_list" || die "the initramfs lacks $module.ko (see $LOG)"
done
grep -q "firmware/$EDID_NAME" <<<"$initrd_list" || die "the initramfs lacks $EDID_NAME (see $LOG)"
mesa=$(chroot "$ROOT" dpkg-query -W -f '${Version}' libgl1-mesa-dri)
npkgs=$(chroot "$ROOT" dpkg-query -W -f '.\n' | wc -l)
log "    done in $((SECONDS - t)) s: kernel $kver, Mesa $mesa, $npkgs packages"

log "step 5/6 ($(elapsed "$started")): installing the init, vgpu-load, vgpu-agent and CUDA, pruning docs, locales, caches and unneeded kernel modules"
install -m 0755 "$INIT_SRC" "$ROOT/usr/local/sbin/vgpu-init"
install -m 0755 "$load_bin" "$ROOT/usr/local/bin/vgpu-load"
install -m 0755 "$agent_bin" "$ROOT/usr/local/bin/vgpu-agent"
cp "$cuda_deb" "$ROOT/tmp/vgpu-guest-cuda.deb"
run_logged "installing the guest CUDA package" chroot "$ROOT" "${chroot_env[@]}" \
    dpkg -i /tmp/vgpu-guest-cuda.deb
rm "$ROOT/tmp/vgpu-guest-cuda.deb"
ncorpus=0
if [[ -d $CORPUS ]]; then
    mkdir -p "$ROOT/usr/local/share/vgpu-cuda"
    find "$CORPUS" -maxdepth 1 -type f -exec cp -t "$ROOT/usr/local/share/vgpu-cuda" {} +
    ncorpus=$(find "$ROOT/usr/local/share/vgpu-cuda" -type f | wc -l)
fi
chroot "$ROOT" ldconfig
cp "$ROOT/boot/vmlinuz-$kver" "$WORK/vmlinuz"
cp "$ROOT/boot/initrd.img-$kver" "$WORK/initrd.img"
rm -f "$ROOT/usr/sbin/policy-rc.d"
rm -rf "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* \
    "$ROOT"/usr/share/locale/* "$ROOT"/usr/share/lintian/* "$ROOT"/var/lib/apt/lists/* \
    "$ROOT"/var/cache/apt/* "$ROOT"/var/cache/debconf/*-old "$ROOT"/var/log/* "$ROOT"/boot/*
moddir=$ROOT/lib/modules/$kver/kernel
for tree in "${PRUNE_MODULES[@]}"; do rm -rf "${moddir:?}/$tree"; done
find "$ROOT/usr/lib/firmware" -mindepth 1 -maxdepth 1 ! -name edid -exec rm -rf {} +
chroot "$ROOT" depmod -a "$kver"
umount_chroot

log "step 6/6 ($(elapsed "$started")): packing the root file system with mkfs.ext4 -d"
used_mib=$(du -sm "$ROOT" | cut -f1)
size_mib=$((used_mib + used_mib / 4 + 64))
truncate -s "${size_mib}M" "$WORK/rootfs.ext4"
run_logged "mkfs.ext4" mkfs.ext4 -q -F -L vgpu-root -m 0 -O ^has_journal -E root_owner=0:0 \
    -d "$ROOT" "$WORK/rootfs.ext4"
rm -rf "$ROOT"

summary="kernel $kver, Mesa $mesa, $npkgs packages, $ncorpus CUDA programs, rootfs ${used_mib} MiB in a ${size_mib} MiB ext4"
printf 'suite %s\nkernel %s\nmesa %s\npackages %s\nrootfs_used_mib %s\nrootfs_size_mib %s\nvgpu_load_sha256 %s\n' \
    "$SUITE" "$kver" "$mesa" "$npkgs" "$used_mib" "$size_mib" "$load_sha" >"$WORK/manifest.txt"
{ fingerprint; echo "$summary"; } >"$WORK/.vgpu-guest-complete"
rm -rf "$OUT"
mv "$WORK" "$OUT"
log "guest image ready in $((SECONDS - started)) s: $summary ($OUT)"
