# Sourced by the README's commands (demo.sh, test.sh): moves to the repository root, checks the
# toolchain and installs the QEMU prefix, printing numbered steps. Set STEPS before sourcing.
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
step "QEMU prefix"
qemu-scripts/setup-qemu.sh
