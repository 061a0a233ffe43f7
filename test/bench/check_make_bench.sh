#!/usr/bin/env bash
# `make bench` builds the benchmark it runs and nothing else; `make test` builds everything
# (CTest test make.bench_targets). Reads the Makefile's commands with `make -n`, runs none.
#   usage: test/bench/check_make_bench.sh <source dir>
set -euo pipefail

src=${1:?usage: check_make_bench.sh <source dir>}
build=/nonexistent/td_make_bench_check  # make -n only prints it

fail() {
  echo "check_make_bench: $*" >&2
  exit 1
}

bench=$(make -n -C "$src" --no-print-directory bench BUILD_DIR="$build")
builds=$(grep -E 'cmake +--build' <<<"$bench" || true)
[[ -n $builds ]] || fail "make bench runs no cmake --build:"$'\n'"$bench"
while read -r line; do
  [[ $line == *"--target bench_allreduce"* ]] || fail "make bench builds more than the benchmark: $line"
done <<<"$builds"
grep -qE 'mpirun .*-np 2 .*bench_allreduce' <<<"$bench" || fail "make bench does not run bench_allreduce at 2 ranks"
grep -qF -- "--csv $build/bench/allreduce.csv" <<<"$bench" || fail "make bench writes no $build/bench/allreduce.csv"
grep -qF -- "--plot-dir $build/bench" <<<"$bench" || fail "make bench puts the plot elsewhere than $build/bench"

test_cmds=$(make -n -C "$src" --no-print-directory test BUILD_DIR="$build")
grep -E 'cmake +--build' <<<"$test_cmds" | grep -qv -- '--target' ||
  fail "make test does not build everything:"$'\n'"$test_cmds"
echo "check_make_bench: ok"
