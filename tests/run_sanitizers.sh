#!/usr/bin/env bash
# run_sanitizers.sh - every kernel check under every compute-sanitizer tool, one process per
# (tool, check), so a check that a tool kills (a sticky CUDA error) hides nothing else.
#
#   tests/run_sanitizers.sh [tool ...]          # default tools: memcheck racecheck synccheck
#   CHECKS='copy_*' tests/run_sanitizers.sh memcheck racecheck   # the copy kernel, directly and
#                                                # through every executor's copy lowering
#
# Environment (all optional):
#   SANITIZER  the compute-sanitizer to run (default: compute-sanitizer on PATH)
#   PYTHON     the interpreter (default: python3)
#   CHECKS     check names or shell patterns (copy_*), space-separated (default: all of
#              tests/kernel_checks.py --list)
#   CUBINS     directory of prebuilt cubins (tests/kernel_checks.py --build-cubins DIR)
#   LOGDIR     where the per-run logs go (default: a new temporary directory)
#   TIMEOUT    seconds per run (default: 900)
# Checks run with --small. One line per (tool, check), then a table; exit 1 when any run
# reported an error, failed its check or did not finish. synccheck needs compute-sanitizer
# 2025.4+ and cubins from NVRTC 13.1+ for the block-scope cuda::pipeline kernels (docs/kernels.md).
set -u
cd "$(dirname "$0")/.."
SAN=${SANITIZER:-compute-sanitizer}
PY=${PYTHON:-python3}
TOOLS=${*:-memcheck racecheck synccheck}
ALL_CHECKS=$("$PY" tests/kernel_checks.py --list)
if [ -n "${CHECKS:-}" ]; then  # names or patterns, matched against the known checks
    wanted=$CHECKS
    CHECKS=""
    for pat in $wanted; do
        hit=0
        for c in $ALL_CHECKS; do
            # shellcheck disable=SC2053  # a pattern on purpose
            if [[ $c == $pat ]]; then CHECKS="$CHECKS $c"; hit=1; fi
        done
        [ $hit -eq 1 ] || { echo "no check matches '$pat' (tests/kernel_checks.py --list)" >&2; exit 2; }
    done
else
    CHECKS=$ALL_CHECKS
fi
LOGDIR=${LOGDIR:-$(mktemp -d)}
mkdir -p "$LOGDIR"
extra=(--small)
[ -n "${CUBINS:-}" ] && extra+=(--cubins "$CUBINS")
"$SAN" --version 2>&1 | grep -i version | head -1
echo "logs: $LOGDIR"

declare -A RESULT
bad=0
for tool in $TOOLS; do
    for check in $CHECKS; do
        log="$LOGDIR/$tool.$check.log"
        timeout "${TIMEOUT:-900}" "$SAN" --tool "$tool" --error-exitcode 99 \
            "$PY" tests/kernel_checks.py "${extra[@]}" "$check" >"$log" 2>&1
        rc=$?
        summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | head -1 | sed 's/^=* *//')
        if [ $rc -eq 124 ]; then
            status=TIMEOUT
        elif [ $rc -eq 0 ] && grep -q -E "^(PASS|SKIP) $check" "$log"; then
            status=ok
        elif grep -q -E "^PASS $check" "$log"; then
            status=ERRORS   # the check's output was right, the tool reported errors
        else
            status=FAIL
        fi
        [ "$status" = ok ] || bad=1
        RESULT[$tool.$check]=$status
        printf '%-10s %-22s %-8s rc=%-3s %s\n' "$tool" "$check" "$status" "$rc" "${summary:-(no summary)}"
    done
done

echo
printf '%-22s' check
for tool in $TOOLS; do printf ' %-10s' "$tool"; done
echo
for check in $CHECKS; do
    printf '%-22s' "$check"
    for tool in $TOOLS; do printf ' %-10s' "${RESULT[$tool.$check]}"; done
    echo
done
[ $bad -eq 0 ] && echo "all runs clean" || echo "some runs not clean: see $LOGDIR"
exit $bad
