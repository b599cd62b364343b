# The transformers releases .ci/run tests, sourced by it (and by tests/scripts/test_ci_releases.py).

pinned_release() { sed -n 's/^transformers==//p' "$1"; }

# The releases the second stage runs: the previous pin and the newest, in that order, each once,
# leaving out the pin itself (its whole suite, the subset included, ran in the first stage).
releases_to_check() {
    local pin=$1
    shift
    printf '%s\n' "$@" | awk -v pin="$pin" 'NF && $0 != pin && !seen[$0]++'
}
