#!/usr/bin/env bash
# checkpoint_killed.sh EXPECT_OUTCOME MPIEXEC FLAGS... -- PROGRAM: a rank killed during a
# parallel save (fault_checkpoint_killed save, which must end non-zero), then the check that the
# previous checkpoint is intact (fault_checkpoint_killed verify, exit 0).
set -u
expect=$1 mpiexec=$2
shift 2
flags=()
while [[ $1 != -- ]]; do flags+=("$1"); shift; done
prog=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
bash "$expect" 60 nonzero "killing myself during the save" -- \
  "$mpiexec" -n 2 "${flags[@]}" "$prog" save "$dir" || exit 1
ls -la "$dir"
"$prog" verify "$dir" || exit 1
