#!/usr/bin/env bash
# A one-round bench_backward at 2 ranks: it exits 0 (its correctness guard passed: the Reducer's
# result is the bits of all_reduce's) and prints every summary the docs quote.
# Usage: check_bench_backward.sh MPIEXEC BENCH_BACKWARD [mpiexec flags...]
set -euo pipefail
mpiexec=$1 bench=$2
shift 2
out=$("$mpiexec" "$@" -n 2 "$bench" --rounds 1 --op sum 2>/dev/null)
for want in '^communication: Reducer buckets ' '^communication: pre-packed MPI_Allreduce ' \
            '^# idle: Reducer step / max\(compute, communication\) = ' \
            '^# idle: best overlap possible .* Reducer step / best possible = ' \
            '^# Reducer buckets alone / pre-packed MPI_Allreduce = ' '^# mark_ready '; do
  if ! grep -Eq "$want" <<<"$out"; then
    echo "bench_backward: no line matching '$want' in:" >&2
    echo "$out" >&2
    exit 1
  fi
done
echo "bench_backward output: ok"
