#!/usr/bin/env bash
# Installs QEMU 11.1 (qemu-system-x86 with vfio-user-pci, plus the OpenGL display modules and the
# EGL stack they load) from Debian trixie-backports as an extracted prefix under
# ${VGPU_CACHE:-$HOME/.cache/vgpu}/qemu, with QEMU's vhost-user-gpu backend (usr/lib/qemu) taken
# from qemu-system-gui: only that binary and its description, since the rest of the package
# (GTK/SDL displays, audio) would pull in a desktop's worth of libraries it does not need.
#
# No root needed and the host's apt/dpkg state is never touched: a private APT configuration with
# an empty dpkg status file resolves the whole dependency closure (trixie's libc included), the
# packages are only downloaded, and each one is unpacked with `dpkg -x`. QEMU then runs through the
# prefix's own dynamic loader (see the qemu-system-x86_64 wrapper beside this script).
#
# Idempotent: a completed prefix is recognised by its stamp file and the script returns at once.
# Environment: VGPU_CACHE (cache root), VGPU_DEBIAN_MIRROR (archive URL; default: the Debian
# mirror this host's apt sources use).
set -euo pipefail

CACHE=${VGPU_CACHE:-$HOME/.cache/vgpu}
PREFIX=$CACHE/qemu
STAMP=$PREFIX/.vgpu-prefix-complete
# libegl1 (the GLVND loader) and libegl-mesa0 (Mesa's EGL vendor) must come from the same Mesa
# as the prefix's libgbm1: without them the OpenGL display modules (egl-headless, used by
# virtio-gpu-gl-pci) load the host's older libEGL, which crashes against the prefix's GBM.
PACKAGES=(qemu-system-x86 qemu-system-modules-opengl libegl1 libegl-mesa0)
# Files taken from qemu-system-gui (its other dependencies are all in the closure above).
GUI_FILES=(./usr/lib/qemu/vhost-user-gpu ./usr/share/qemu/vhost-user/50-qemu-gpu.json)
# Bump when the package set or the layout changes, so older prefixes are rebuilt.
# 2: libegl1 and libegl-mesa0 added. 3: vhost-user-gpu.
LAYOUT=3

log() { printf '[setup-qemu] %s\n' "$*" >&2; }
source "$(dirname "${BASH_SOURCE[0]}")/progress.sh"
die() { printf '[setup-qemu] error: %s\n' "$*" >&2; exit 1; }

if [[ -f $STAMP && $(head -n1 "$STAMP") == "layout $LAYOUT" && -x $PREFIX/usr/bin/qemu-system-x86_64 ]]; then
    log "QEMU prefix ready: $(sed -n 2p "$STAMP") ($PREFIX)"
    exit 0
fi

for tool in apt-get dpkg dpkg-deb; do
    command -v "$tool" >/dev/null || die "'$tool' not found: this script needs a Debian-based host"
done

source "$(dirname "${BASH_SOURCE[0]}")/debian-mirror.sh"
MIRROR=$(debian_mirror)
[[ -n $MIRROR ]] || die "no Debian mirror found in /etc/apt sources; set VGPU_DEBIAN_MIRROR"

APTDIR=$CACHE/qemu-apt
mkdir -p "$APTDIR"/etc/sources.list.d "$APTDIR"/etc/preferences.d "$APTDIR"/etc/apt.conf.d \
    "$APTDIR"/lists/partial "$APTDIR"/archives/partial "$APTDIR"/dpkg
: > "$APTDIR/dpkg/status"
cat > "$APTDIR/etc/sources.list" <<SRC
deb $MIRROR trixie main
deb $MIRROR trixie-updates main
deb $MIRROR trixie-backports main
SRC
cat > "$APTDIR/apt.conf" <<CONF
Dir::State "$APTDIR";
Dir::State::Lists "$APTDIR/lists";
Dir::State::status "$APTDIR/dpkg/status";
Dir::Cache "$APTDIR";
Dir::Cache::Archives "$APTDIR/archives";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Dir::Etc "$APTDIR/etc";
Dir::Etc::SourceList "$APTDIR/etc/sources.list";
Dir::Etc::SourceParts "$APTDIR/etc/sources.list.d";
Dir::Etc::Preferences "$APTDIR/etc/preferences";
Dir::Etc::PreferencesParts "$APTDIR/etc/preferences.d";
Dir::Etc::Parts "$APTDIR/etc/apt.conf.d";
Dir::Etc::Trusted "/etc/apt/trusted.gpg";
Dir::Etc::TrustedParts "/etc/apt/trusted.gpg.d";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Debug::NoLocking "true";
CONF
export APT_CONFIG=$APTDIR/apt.conf

started=$SECONDS
log "step 1/4: reading the trixie and trixie-backports package lists from $MIRROR"
if ! apt-get -q update --error-on=any >"$APTDIR/update.log" 2>&1; then
    sed 's/^/    /' "$APTDIR/update.log" >&2
    die "the Debian archive at $MIRROR is unreachable or incomplete (see above); check the network or set VGPU_DEBIAN_MIRROR"
fi

log "step 2/4 ($(elapsed "$started")): downloading ${PACKAGES[*]} from trixie-backports with their dependency closure"
apt-get -q -y --download-only -t trixie-backports install "${PACKAGES[@]}" 2>&1 | apt_progress "    " || true
mapfile -t debs < <(find "$APTDIR/archives" -maxdepth 1 -name '*.deb' | sort)
((${#debs[@]} > 0)) || die "apt-get downloaded nothing; see the output above"
version=$(dpkg-deb -f "$(ls "$APTDIR"/archives/qemu-system-x86_*.deb | tail -n1)" Version 2>/dev/null) ||
    die "qemu-system-x86 was not downloaded; see the output above"

log "step 3/4 ($(elapsed "$started")): unpacking ${#debs[@]} packages into $PREFIX"
rm -rf "$PREFIX.partial"
mkdir -p "$PREFIX.partial"
i=0
for deb in "${debs[@]}"; do
    i=$((i + 1))
    if ((i % 10 == 0 || i == ${#debs[@]})); then log "    unpacked $i/${#debs[@]}"; fi
    dpkg -x "$deb" "$PREFIX.partial"
done
[[ -x $PREFIX.partial/usr/bin/qemu-system-x86_64 ]] || die "qemu-system-x86_64 missing after unpacking"

log "step 4/4 ($(elapsed "$started")): vhost-user-gpu from qemu-system-gui $version"
rm -f "$APTDIR"/qemu-system-gui_*.deb
(cd "$APTDIR" && apt-get -q download "qemu-system-gui=$version" >"$APTDIR/gui.log" 2>&1) ||
    { sed 's/^/    /' "$APTDIR/gui.log" >&2; die "downloading qemu-system-gui $version failed"; }
dpkg-deb --fsys-tarfile "$APTDIR"/qemu-system-gui_*.deb | tar -x -C "$PREFIX.partial" "${GUI_FILES[@]}"
rm -f "$APTDIR"/qemu-system-gui_*.deb
[[ -x $PREFIX.partial/usr/lib/qemu/vhost-user-gpu ]] || die "vhost-user-gpu missing after unpacking"
printf 'layout %s\nqemu-system-x86 %s\n' "$LAYOUT" "$version" > "$PREFIX.partial/.vgpu-prefix-complete"
rm -rf "$PREFIX"
mv "$PREFIX.partial" "$PREFIX"
rm -f "$APTDIR"/archives/*.deb
log "QEMU prefix ready in $(elapsed "$started"): qemu-system-x86 $version ($PREFIX, $(du -sh "$PREFIX" | cut -f1))"
