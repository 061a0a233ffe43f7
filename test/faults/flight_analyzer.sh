#!/usr/bin/env bash
# The flight-recorder dumps of a fault_diagnosis run, read back by td-flight (issue 29):
#   flight_analyzer.sh SCENARIO RANKS TD_FLIGHT -- mpiexec ... fault_diagnosis SCENARIO
# Runs the scenario with TD_FLIGHT_RECORDER_DIR set (every rank writes rank-<r>.json at the first
# timeout: the ranks that time out, and the others when asked), then checks td-flight's verdict.
set -u
scenario=$1 ranks=$2 tool=$3
shift 4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
TD_FLIGHT_RECORDER_DIR=$dir timeout --kill-after=5 60 "$@" >"$dir/run.log" 2>&1
if ! grep -q "diagnosis $scenario: ok" "$dir/run.log"; then
  cat "$dir/run.log"
  echo "FAIL: the $scenario run did not pass"
  exit 1
fi
count=$(ls "$dir"/rank-*.json 2>/dev/null | wc -l)
if [[ $count -ne $ranks ]]; then
  ls -l "$dir"
  echo "FAIL: expected $ranks dumps, found $count"
  exit 1
fi
"$tool" "$dir" >"$dir/verdict.txt" 2>&1
rc=$?
cat "$dir/verdict.txt"
last=$((ranks - 1))
others="ranks 0-$((last - 1))"
[[ $last -eq 2 ]] && others="ranks 0, 1"
[[ $last -eq 1 ]] && others="rank 0"
expect=("verdict: rank $last did not call #2 (TensorDict.all_reduce ('grads.b', 2 leaves")
[[ $scenario == other_group ]] && expect+=("verdict: $others did not call #1")
if [[ $rc -ne 1 ]]; then echo "FAIL: td-flight exited with $rc, expected 1 (a difference)"; exit 1; fi
for e in "${expect[@]}"; do
  if ! grep -qF -- "$e" "$dir/verdict.txt"; then echo "FAIL: no line with: $e"; exit 1; fi
done
echo PASS
