#!/usr/bin/env bash
# checkpoint_killed.sh EXPECT_OUTCOME RANKS FORMAT MPIEXEC FLAGS... -- PROGRAM: a rank killed
# during a parallel save of FORMAT (safetensors or memmap) by RANKS ranks (fault_checkpoint_killed
# save, which must end non-zero), then the check that the previous checkpoint is intact and
# nothing else appeared under its name (fault_checkpoint_killed verify, exit 0).
set -u
expect=$1 ranks=$2 format=$3 mpiexec=$4
shift 4
flags=()
while [[ $1 != -- ]]; do flags+=("$1"); shift; done
prog=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
bash "$expect" 60 nonzero "killing myself during the save" -- \
  "$mpiexec" -n "$ranks" "${flags[@]}" "$prog" save "$format" "$dir" || exit 1
ls -la "$dir"
"$prog" verify "$format" "$dir" || exit 1
