# Sourced by the long-running set-up scripts (setup-qemu.sh, build-guest-image.sh,
# cuda-corpus.sh): progress on stderr. When stderr is a terminal a counter line is redrawn in
# place (with a bar once the total is known); otherwise plain lines, a few per phase, so that
# logs and CI output stay readable. The scripts' numbered steps are theirs (like common.sh's
# `step` for the top-level commands); this adds what happens inside a step.

PROGRESS_TTY=0
[[ -t 2 ]] && PROGRESS_TTY=1

# The time since $1 (a $SECONDS value), as 1m05s.
elapsed() {
    local s=$((SECONDS - $1))
    printf '%dm%02ds' $((s / 60)) $((s % 60))
}

# Reads apt-get or debootstrap output on stdin and prints its progress on stderr, each line
# indented by $1: packages retrieved, downloaded, unpacked and configured (out of the total
# apt announces, "N newly installed"), debootstrap's phases, and apt's errors and sizes. Every
# line read is also appended to the file $PROGRESS_LOG when the caller sets it.
apt_progress() {
    awk -v tty="$PROGRESS_TTY" -v logfile="${PROGRESS_LOG:-}" -v indent="$1" '
        function count(what, k,   text, done, bar) {
            text = indent what " " k (total ? "/" total : "") " packages"
            if (tty) {
                if (total) {
                    done = int(30 * (k > total ? total : k) / total)
                    bar = sprintf("%" done "s", ""); gsub(/ /, "=", bar)
                    text = text sprintf(" [%-30s]", bar)
                }
                printf "\r\033[K%s", text; fflush(); drawn = 1
            } else if (k % 50 == 0 || k == total) {
                print text; fflush()
            }
        }
        function line(text) {
            if (drawn) { printf "\r\033[K"; drawn = 0 }
            print indent text; fflush()
        }
        logfile != "" { print >> logfile; fflush(logfile) }
        / upgraded, [0-9]+ newly installed/ { total = $3; line($0); next }
        /^I: Retrieving / { count("retrieved", ++r); next }
        /^I: Extracting / { count("extracted", ++x); next }
        /^I: (Unpacking|Configuring) [^ ]+$/ { count("set up", ++c); next }
        /^I: .*(\.\.\.|successfully\.?)$/ { if ($2 != last) { line($0); last = $2 } next }
        /^Get:/ { count("downloaded", ++n); next }
        /^Unpacking / { count("unpacked", ++u); next }
        /^Setting up / { count("configured", ++s); next }
        /^(E:|W: Possible missing|update-initramfs:|Need to get |Fetched )/ { line($0) }
        END { if (drawn) printf "\n" }
    ' >&2
}
