# Sourced by the README's commands (demo.sh, test.sh): moves to the repository root, checks the
# toolchain, installs the host's Debian packages and the QEMU prefix, printing numbered steps.
# Set STEPS before sourcing, and EXTRA_DEBS (an array) for Debian packages the caller needs
# beyond the renderer's.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
step_no=0
# Free space (GiB, rounded down) on the file system holding the repository: its build
# directories are the largest thing these commands write.
free_gib() { df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }'; }
step() {
    step_no=$((step_no + 1))
    printf '\n== [%s/%s] %s (%s GiB free)\n' "$step_no" "$STEPS" "$1" "$(free_gib)"
}
# need_disk GIB WHAT: stops at once when less than GIB GiB are free, instead of minutes later
# with "No space left on device" in the middle of a build.
need_disk() {
    local free
    free=$(free_gib)
    ((free >= $1)) && return 0
    echo "$(basename "$0"): only $free GiB free on the file system of $PWD; $2 needs about $1 GiB" >&2
    exit 1
}
command -v cargo >/dev/null || {
    echo "$(basename "$0"): cargo not found; install the Rust toolchain (rustup)" >&2
    exit 1
}
# Installs the Debian packages named that are not installed yet (root, or sudo).
ensure_debs() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    local sudo=()
    [[ $(id -u) == 0 ]] || sudo=(sudo)
    echo "installing Debian packages: ${missing[*]}"
    "${sudo[@]}" apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
}

step "host packages and QEMU prefix"
# virglrenderer and Mesa's EGL (llvmpipe when there is no GPU) for the host renderer.
ensure_debs libvirglrenderer1 libegl1 libegl-mesa0 libgles2 libgl1-mesa-dri libgbm1 \
    ${EXTRA_DEBS[@]+"${EXTRA_DEBS[@]}"}
qemu-scripts/setup-qemu.sh
