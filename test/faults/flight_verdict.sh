#!/usr/bin/env bash
# td-flight on hand-made dumps (test/data/flight/<case>/rank-*.json):
#   flight_verdict.sh TD_FLIGHT CASE_DIR
# Its output, then "exit status N", must equal CASE_DIR/expected.txt line for line.
set -u
tool=$1 case_dir=$2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$tool" "$case_dir" >"$out" 2>&1
echo "exit status $?" >>"$out"
if ! diff -u "$case_dir/expected.txt" "$out"; then
  echo "FAIL: td-flight's output differs from $case_dir/expected.txt (above: - expected, + actual)"
  exit 1
fi
echo PASS
