#!/usr/bin/env bash
# One way of writing the flight recorder's dumps (test/faults/fault_dumps.cpp), then the check of
# what it left:
#   flight_dumps.sh HOW EXIT(zero|nonzero) FAULT_DUMPS -- mpiexec ... fault_dumps run HOW
set -u
how=$1 exit_kind=$2 program=$3
shift 4
dir=$(mktemp -d)
log=$(mktemp)
trap 'rm -rf "$dir" "$log"' EXIT
TD_FLIGHT_RECORDER_DIR=$dir timeout --kill-after=5 60 "$@" >"$log" 2>&1
rc=$?
cat "$log"
echo "--- exit code $rc"
if [[ $rc -eq 124 ]]; then echo "FAIL: did not end within 60 s"; exit 1; fi
if [[ $exit_kind == zero && $rc -ne 0 ]]; then echo "FAIL: expected exit code 0"; exit 1; fi
if [[ $exit_kind == nonzero && $rc -eq 0 ]]; then echo "FAIL: expected a non-zero exit code"; exit 1; fi
"$program" check "$how" "$dir" "$log"
