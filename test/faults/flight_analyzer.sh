#!/usr/bin/env bash
# The flight-recorder dumps of a fault_diagnosis run, read back by td-flight (issue 29):
#   flight_analyzer.sh SCENARIO RANKS TD_FLIGHT -- mpiexec ... fault_diagnosis SCENARIO
# Runs the scenario with TD_FLIGHT_RECORDER_DIR set (every rank that times out writes
# rank-<r>.json at its first timeout, and every rank it asks writes its own; other_collective's
# ranks write theirs with td::dump_flight_recorder), then checks the number of dumps and
# td-flight's lines for that scenario. A rank that exited, or blocks in MPI without its answering
# thread, writes none: td-flight must say its dump is missing, never that it did not call.
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
"$tool" "$dir" >"$dir/verdict.txt" 2>&1
rc=$?
cat "$dir/verdict.txt"

last=$((ranks - 1))
case $last in
  1) others="rank 0" ;;
  2) others="ranks 0, 1" ;;
  *) others="ranks 0-$((last - 1))" ;;
esac
grads="TensorDict.all_reduce ('grads.b', 2 leaves, 288 bytes, float32)"
first="its last: #1 $grads, completed"
dumps=$ranks
expect=()  # lines (fixed strings) td-flight must print
reject=()  # and must not
case $scenario in
  sleep)
    expect+=("verdict: rank $last did not call #2 ($grads)"
             "rank $last: missing ($first; at its dump: outside the library for ") ;;
  no_call)
    expect+=("first difference at #1 (no call in common before it):"
             "verdict: rank $last did not call #1 ($grads)"
             "rank $last: missing (no call on this group; at its dump: outside the library, no call made yet)")
    reject+=("#1-#0") ;;
  other_call)
    expect+=("verdict: rank $last did not call #2 ($grads)"
             "rank $last: missing ($first; at its dump: in td.recv_dict #1 (point to point) on group 1)") ;;
  other_group)
    expect+=("verdict: rank $last did not call #2 ($grads)"
             "rank $last: missing ($first; at its dump: in TensorDict.all_reduce #1 on group 2)"
             "verdict: $others did not call #1 ($grads)") ;;
  other_collective)
    # Each rank wrote its dump before the verdict's all_reduce on world, and rank 0's td::abort
    # left its file alone: no difference on world.
    expect+=("verdict: the ranks called different collectives at #2: $others TensorDict.all_reduce; rank $last barrier"
             "ranks agree on call #1; first difference at #2:")
    reject+=("did not call") ;;
  extra_step)
    expect+=("verdict: $others did not call #3 (Reducer step ('w', 1 leaves, 1024 bytes, float32)): rank $last ran more Reducer steps than $others") ;;
  exited | raw_mpi)
    dumps=$last
    expect+=("no dump from rank $last"
             "verdict: #2 ($grads) did not complete on $others; rank $last left no dump: unknown whether it called it")
    reject+=("did not call") ;;
  silent_async)
    # The dumps are taken at rank 0's first timeout: a rank whose buckets all completed may be in
    # the verdict's all_reduce already (a true "did not call" on that group); rank L is never
    # blamed.
    dumps=$last
    expect+=("no dump from rank $last"
             "rank $last left no dump: unknown whether it called it")
    reject+=("$last did not call") ;;
  *)
    echo "FAIL: no expectations for scenario $scenario"
    exit 1 ;;
esac

count=$(ls "$dir"/rank-*.json 2>/dev/null | wc -l)
if [[ $count -ne $dumps ]]; then
  ls -l "$dir"
  echo "FAIL: expected $dumps dumps, found $count"
  exit 1
fi
if [[ $rc -ne 1 ]]; then echo "FAIL: td-flight exited with $rc, expected 1 (a difference)"; exit 1; fi
for e in "${expect[@]}"; do
  if ! grep -qF -- "$e" "$dir/verdict.txt"; then echo "FAIL: no line with: $e"; exit 1; fi
done
for e in "${reject[@]}"; do
  if grep -qF -- "$e" "$dir/verdict.txt"; then echo "FAIL: a line with: $e"; exit 1; fi
done
echo PASS
