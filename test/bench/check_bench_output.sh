#!/usr/bin/env bash
# Runs bench_allreduce briefly at 2 ranks and checks what a reader gets (CTest test
# bench.output): results alone on stdout and progress on stderr, in both progress modes; every
# "Nx faster/slower than" phrase with N >= 1; and a plot script that explains itself (title,
# axis labels with units, "lower is better", several labelled y ticks, the reference drawn where
# it is measured).
#   usage: test/bench/check_bench_output.sh <bench_allreduce> [mpiexec flags...]
# Honours MPIEXEC.
set -euo pipefail

bench=${1:?usage: check_bench_output.sh <bench_allreduce> [mpiexec flags...]}
shift
mpiexec=${MPIEXEC:-mpirun}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/td_bench_output.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

fail() {
  echo "check_bench_output: $*" >&2
  exit 1
}

run() {  # run <name> <bench options...>: stdout to $tmp/<name>.out, stderr to $tmp/<name>.err
  local name=$1
  shift
  "$mpiexec" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" ||
    { cat "$tmp/$name.out" "$tmp/$name.err"; fail "$name: bench_allreduce failed"; }
}

common=(--workloads tiny,mixed --buckets none,64KiB,1MiB,auto --iters 1 --warmup 0)
run log "$@" -np 2 "$bench" "${common[@]}" --progress log --plot-dir "$tmp/plot"
run line "$@" -np 2 "$bench" "${common[@]}" --progress line --no-plot
cat "$tmp/log.out"

# 1. stdout: the header, both tables and their summaries, and nothing of the progress.
for f in log line; do
  grep -q '^== tiny: ' "$tmp/$f.out" || fail "$f: no tiny table on stdout"
  grep -q '^summary mixed: ' "$tmp/$f.out" || fail "$f: no mixed summary on stdout"
  if grep -q '\[bench\]' "$tmp/$f.out"; then fail "$f: progress lines on stdout"; fi
  if grep -q $'\r\|\e' "$tmp/$f.out"; then fail "$f: control characters on stdout"; fi
done
# 2. stderr: the progress, as lines (log) or as one line rewritten in place (line).
grep -q '^\[bench\] tiny: .*done in' "$tmp/log.err" || fail "log: no progress lines on stderr"
if grep -q $'\r' "$tmp/log.err"; then fail "log: carriage returns on stderr"; fi
grep -q $'\r\e\\[K\\[bench\\] mixed' "$tmp/line.err" || fail "line: no in-place progress on stderr"

# 3. Wording: a factor is never below 1; "slower" says which way it goes.
phrases=$(grep -oE '[0-9]+\.[0-9]+x (faster|slower) than [a-z-]+' "$tmp/log.out" "$tmp/line.out" ||
  true)
[[ -n $phrases ]] || fail "no 'Nx faster/slower than' phrase in the summaries"
while read -r phrase; do
  factor=${phrase#*:}
  factor=${factor%%x *}
  awk -v f="$factor" 'BEGIN { exit !(f >= 1.0) }' || fail "factor below 1 in '$phrase'"
done <<<"$phrases"

# 4. The plot script.
gp=$tmp/plot/allreduce.gp
[[ -s $gp ]] || fail "no plot script $gp"
for want in "lower is better" "set xlabel 'bucket_bytes" "set y2label 'median time per call (ms)'" \
  "Reference (1x): the faster of two raw-MPI baselines" "MPI_Allreduce in 4MiB chunks" \
  "tiny: 16384 leaves" "mixed: 3000 leaves" "dtype float32, mixed: 4 dtypes"; do
  grep -qF "$want" "$gp" || fail "plot script lacks '$want'"
done
if grep -q "title 'bucket_bytes = x'\|ideal (1 call per dtype)" "$gp" &&
  ! grep -q "Reference (1x)" "$gp"; then
  fail "plot script uses the old legend"
fi
# Every panel labels at least three y ticks.
while read -r line; do
  n=$(grep -o "'[0-9.e+-]*x'" <<<"$line" | wc -l)
  ((n >= 3)) || fail "a panel labels $n y tick(s): $line"
done < <(grep '^set ytics' "$gp")
# The reference is the faster raw-MPI line: one of the two sits at 1.00x, neither below it.
for panel in 1 2; do
  ratios=$(grep -oE "title 'MPI_Allreduce (per dtype|in 4MiB chunks) \([0-9.]+x\)'" "$gp" |
    sed -n "$((2 * panel - 1)),$((2 * panel))p" | grep -oE '[0-9.]+x' | tr -d x)
  [[ $(wc -l <<<"$ratios") -eq 2 ]] || fail "panel $panel: not two raw-MPI lines: $ratios"
  awk 'NR == 1 { m = $1 } $1 < m { m = $1 } END { exit !(m == 1.00) }' <<<"$ratios" ||
    fail "panel $panel: the faster raw-MPI line is not at 1.00x: $ratios"
done
if command -v gnuplot >/dev/null 2>&1; then
  [[ -s $tmp/plot/allreduce.png ]] || fail "gnuplot is installed but no PNG was written"
fi
echo "check_bench_output: ok"
