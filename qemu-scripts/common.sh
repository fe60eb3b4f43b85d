# Sourced by the README's commands (demo.sh, test.sh): moves to the repository root, checks the
# toolchain, installs the host's Debian packages and the QEMU prefix, printing numbered steps.
# Set STEPS before sourcing, and EXTRA_DEBS (an array) for Debian packages the caller needs
# beyond the renderer's.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
step_no=0
step() {
    step_no=$((step_no + 1))
    printf '\n== [%s/%s] %s\n' "$step_no" "$STEPS" "$1"
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
