#!/usr/bin/env bash
# Runs make targets one after another and says how long each took, as it ends and in a line at the end,
# so that a stage which grows shows when it does. Stops at the first that fails, with its status.
set -uo pipefail
cd "$(dirname "$0")/.."

report=()
started=$SECONDS
summary() {
    printf 'stages: %s; total %d s\n' "$(IFS=,; echo "${report[*]}" | sed 's/,/, /g')" $((SECONDS - started)) >&2
}
for target in "$@"; do
    start=$SECONDS
    make --no-print-directory "$target"
    status=$?
    took=$((SECONDS - start))
    report+=("$target $took s")
    if ((status != 0)); then
        printf 'stage %s failed (%d) after %d s\n' "$target" "$status" "$took" >&2
        summary
        exit "$status"
    fi
    printf 'stage %s: %d s\n' "$target" "$took" >&2
done
summary
