# Sourced by the installers (setup-qemu.sh, build-guest-image.sh): finds the Debian archive this
# host's apt sources use, so no mirror host name is ever written into the repository.
#
# Defines `debian_mirror`, which prints VGPU_DEBIAN_MIRROR when set, else the first non-security
# http(s) URI of /etc/apt/sources.list.d/*.sources (deb822) or of the one-line-style
# /etc/apt/sources.list and sources.list.d/*.list files; it prints nothing when none is found.

# The first non-security archive URI in this host's apt sources.
host_debian_mirror() {
    local f
    {
        for f in /etc/apt/sources.list.d/*.sources; do
            [[ -f $f ]] || continue
            awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/) { print $i; exit } }' "$f"
        done
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
            [[ -f $f ]] || continue
            awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:/ && $i !~ /security/) { print $i; exit } }' "$f"
        done
    } | head -n1
}

# VGPU_DEBIAN_MIRROR, or the host's mirror.
debian_mirror() {
    if [[ -n ${VGPU_DEBIAN_MIRROR:-} ]]; then
        printf '%s\n' "$VGPU_DEBIAN_MIRROR"
    else
        host_debian_mirror
    fi
}
