#!/usr/bin/env bash
# Runs a fault-injection program and checks how it ended:
#   expect_outcome.sh MAX_SECONDS EXIT(zero|nonzero) REGEX -- command...
# Fails if the command runs longer than MAX_SECONDS (a hang), exits the wrong way, or its
# combined output does not match REGEX (grep -E).
set -u
max=$1 exit_kind=$2 regex=$3
shift 4
out=$(mktemp)
trap 'rm -f "$out"' EXIT
start=$(date +%s%N)
timeout --kill-after=5 "$max" "$@" >"$out" 2>&1
rc=$?
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
cat "$out"
echo "--- exit code $rc after ${elapsed_ms} ms (limit ${max} s)"
# timeout(1) says 124 when it had to stop the command; mpiexec itself may exit 137 when a rank
# was killed, which is an outcome under test, not a hang.
if [[ $rc -eq 124 ]] || (( elapsed_ms >= max * 1000 )); then
  echo "FAIL: did not end within ${max}s"
  exit 1
fi
if [[ $exit_kind == zero && $rc -ne 0 ]]; then echo "FAIL: expected exit code 0"; exit 1; fi
if [[ $exit_kind == nonzero && $rc -eq 0 ]]; then echo "FAIL: expected a non-zero exit code"; exit 1; fi
if ! grep -Eq -- "$regex" "$out"; then echo "FAIL: output does not match /$regex/"; exit 1; fi
echo "PASS"
