#!/usr/bin/env bash
# td-autotune and the tuner it drives, on a temporary cache directory (CTest test autotune.tool):
#   show / clear list and remove the tuner's entries and nothing else;
#   measure stores an entry (or says why not: a noisy measurement is not kept);
#   the "auto buckets" line is printed once per job, by rank 0, not once per rank;
#   a cached cap that is clearly wrong (1 KiB) fails its spot check and is measured again (under
#   a sanitizer, where 1 KiB measures cheapest, the verdict must follow from the logged timings);
#   node-aware (TD_HIERARCHICAL=1), the line names that path and the entry is the path's own;
#   across (simulated) nodes by default, the path is measured, cached, shown and read back.
#   usage: test/autotune/check_td_autotune.sh <td-autotune> [mpiexec flags...]
# Honours MPIEXEC.
set -euo pipefail

tool=${1:?usage: check_td_autotune.sh <td-autotune> [mpiexec flags...]}
shift
mpi=("${MPIEXEC:-mpirun}" "$@")
tmp=$(mktemp -d "${TMPDIR:-/tmp}/td_autotune.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export TD_CACHE_DIR=$tmp/cache
unset TD_AUTOTUNE_CACHE TD_AUTOTUNE_REFRESH TD_LOG_LEVEL

fail() {
  echo "check_td_autotune: $*" >&2
  exit 1
}
step() { printf '\n== %s\n' "$*"; }

step "show on a directory that does not exist yet"
out=$("$tool" show)
echo "$out"
grep -qF "cache directory: $TD_CACHE_DIR (0 entries)" <<<"$out" || fail "show: wrong empty listing"

step "show and clear: the tuner's entries, and only those"
mkdir -p "$TD_CACHE_DIR"
printf '1048576 262144\n# cap 1024 KiB, leaves of 256 KiB or more sent alone\n' \
  >"$TD_CACHE_DIR/buckets-v4-2ranks-00000000000000aa"
printf 'not ours\n' >"$TD_CACHE_DIR/notes.txt"
out=$("$tool" show)
echo "$out"
grep -qF "(1 entry)" <<<"$out" || fail "show: expected 1 entry"
grep -qF "cap 1024 KiB, leaves of 256 KiB or more sent alone" <<<"$out" || fail "show: no cap"
if grep -q notes.txt <<<"$out"; then fail "show lists a file that is not the tuner's"; fi
out=$("$tool" clear)
echo "$out"
grep -qF "removed 1 entry from $TD_CACHE_DIR" <<<"$out" || fail "clear: wrong report"
[[ ! -e $TD_CACHE_DIR/buckets-v4-2ranks-00000000000000aa ]] || fail "clear left the entry"
[[ -e $TD_CACHE_DIR/notes.txt ]] || fail "clear removed a file that is not the tuner's"
"$tool" show | grep -qF "(0 entries)" || fail "show after clear: not empty"

# One "auto buckets" line per job, from rank 0.
auto_lines() {
  local lines
  lines=$(grep -F 'auto buckets:' <<<"$1" || true)
  [[ $(grep -c . <<<"$lines") -eq 1 ]] || fail "expected one 'auto buckets' line, got:"$'\n'"$lines"
  grep -q '^\[td rank 0 info\] auto buckets:' <<<"$lines" || fail "the line is not rank 0's: $lines"
}

step "measure at 2 ranks"
status=0
out=$("${mpi[@]}" -np 2 "$tool" measure 2>&1) || status=$?
echo "$out"
auto_lines "$out"
file=$(grep -oE "$TD_CACHE_DIR/buckets-[^ )]+" <<<"$out" | head -n 1)
[[ -n $file ]] || fail "measure: the log line names no cache file"
case $status in
  0)
    grep -qF "stored: $file" <<<"$out" || fail "measure: 'stored: $file' missing"
    "$tool" show | grep -qE "measured .* 2 ranks" || fail "show: the new entry has no notes"
    ;;
  3)
    grep -qE "NOT cached: (the machine looks busy \(|[0-9] of 3 passes)" <<<"$out" ||
      fail "measure: exit 3 without a reason"
    [[ ! -e $file ]] || fail "measure: a noisy measurement was stored"
    ;;
  *) fail "measure: exit status $status" ;;
esac

step "a cached cap of 1 KiB fails the spot check and is measured again"
# The spot check keeps a cached cap unless a neighbour wins in every pass, so a pass in which the
# 16 KiB neighbour was preempted on every repetition keeps it: on a loaded machine, try again.
# Under a sanitizer (TD_TEST_SANITIZED=1) the premise does not hold: AddressSanitizer's build
# measured 16 KiB at 0.065 ms against 1 KiB's 0.0023 ms (28x the time for 16x the bytes), so 1 KiB
# IS the cheaper size per byte there. Whichever way the check goes, its verdict must follow from
# the timings it logged (debug level): kept only if, in some pass, 16 KiB was not more than 15%
# cheaper per byte; and outside a sanitizer it must catch the planted cap within three tries.
spot_kept_justified() {
  # The debug line's "1 KiB: packed a/b/c" and "16 KiB: packed x/y/z", per pass.
  local line
  line=$(grep -F 'spot check of the cached cap:' <<<"$1") || fail "check: no spot-check timings"
  awk -v line="$line" 'BEGIN {
      if (!match(line, /1 KiB: packed [0-9.\/]+/)) exit 2
      split(substr(line, RSTART + 14, RLENGTH - 14), cap, "/")
      if (!match(line, /16 KiB: packed [0-9.\/]+/)) exit 2
      n = split(substr(line, RSTART + 15, RLENGTH - 15), big, "/")
      for (p = 1; p <= n; ++p) if (1 - (big[p] / 16) / cap[p] <= 0.15) exit 0
      exit 1
    }'
}
for attempt in 1 2 3; do
  printf '1024 1024\n' >"$file"
  out=$(TD_LOG_LEVEL=debug "${mpi[@]}" -np 2 "$tool" check 2>&1)
  echo "$out"
  auto_lines "$out"
  grep -qF "the cached cap 1 KiB ($file) is off" <<<"$out" && break
  spot_kept_justified "$out" ||
    fail "check: the 1 KiB cap was kept although 16 KiB was cheaper per byte in every pass"
  if [[ ${TD_TEST_SANITIZED:-0} == 1 ]]; then
    echo "check_td_autotune: kept, as the sanitized build's timings say it should be"
    break
  fi
  ((attempt < 3)) || fail "check: the 1 KiB cap was kept three times"
done
if grep -qF "is off" <<<"$out"; then
  grep -qF "measured again" <<<"$out" || fail "check: not measured again"
  if grep -qF "measured again: measured (" <<<"$out"; then
    [[ $(head -c 5 "$file") != "1024 " ]] || fail "check: a clean re-measurement was not stored"
  fi
fi

step "one line per job at 3 ranks too (no cache)"
out=$(TD_AUTOTUNE_CACHE=0 "${mpi[@]}" -np 3 "$tool" check 2>&1)
echo "$out"
auto_lines "$out"
grep -qF "not cached: TD_AUTOTUNE_CACHE=0" <<<"$out" ||
  grep -qE "NOT cached: (the machine looks busy|[0-9] of 3 passes)" <<<"$out" ||
  fail "check: cache-off not reported"

step "node-aware, the tuner times the node-aware path and caches it apart"
# Two simulated nodes of one rank, TD_HIERARCHICAL=1: a call's messages go through the node
# stages, so the tuner's measurement does too, and its entry is not the flat one's ($file).
status=0
out=$(TD_HIERARCHICAL=1 TD_TEST_RANKS_PER_NODE=1 "${mpi[@]}" -np 2 "$tool" measure 2>&1) ||
  status=$?
echo "$out"
[[ $status -eq 0 || $status -eq 3 ]] || fail "node-aware measure: exit status $status"
auto_lines "$out"
grep -qF "(messages node-aware, 2 nodes of 1)" <<<"$out" ||
  fail "node-aware measure: the line does not name the node-aware path"
grep -qF "(messages flat)" <<<"$(TD_AUTOTUNE_CACHE=0 "${mpi[@]}" -np 2 "$tool" check 2>&1)" ||
  fail "flat check: the line does not name the flat path"
na_file=$(grep -oE "$TD_CACHE_DIR/buckets-[^ )]+" <<<"$out" | head -n 1)
[[ -n $na_file && $na_file != "$file" ]] ||
  fail "node-aware measure: cache file '$na_file' is the flat one's ('$file')"

step "the default across nodes: the messages' path measured, cached, shown, read back"
# Two simulated nodes of two ranks, TD_HIERARCHICAL unset (auto): the first all_reduce times a
# flat and a node-aware allreduce and says which it chose in one line of rank 0's; measure stores
# the path entry (unless the timings were too noisy to keep), check then reads it from the cache.
"$tool" clear >/dev/null
status=0
out=$(TD_TEST_RANKS_PER_NODE=2 "${mpi[@]}" -np 4 "$tool" measure 2>&1) || status=$?
echo "$out"
[[ $status -eq 0 || $status -eq 3 ]] || fail "path measure: exit status $status"
lines=$(grep -E "\] messages (flat|node-aware) \(TD_HIERARCHICAL=auto, 2 nodes of 2\)" <<<"$out" || true)
[[ $(grep -c . <<<"$lines") -eq 1 ]] || fail "expected one path line, got:"$'\n'"$lines"
grep -q '^\[td rank 0 info\] messages' <<<"$lines" || fail "the path line is not rank 0's"
grep -qE "per size, median flat / node-aware allreduce: 256 KiB: [0-9.]+ / [0-9.]+ ms; 4096 KiB" \
  <<<"$lines" || fail "the path line has no figures"
chose=$(grep -oE "messages (flat|node-aware)" <<<"$lines" | head -n 1)
if grep -qF "cached in $TD_CACHE_DIR/paths-" <<<"$lines"; then
  path_file=$(grep -oE "$TD_CACHE_DIR/paths-[^ )]+" <<<"$lines" | head -n 1)
  shown=$("$tool" show)
  echo "$shown"
  grep -qF "$path_file" <<<"$shown" || fail "show does not list the path entry"
  grep -qF "  $chose (TD_HIERARCHICAL=auto)" <<<"$shown" || fail "show: not '$chose'"
  out=$(TD_TEST_RANKS_PER_NODE=2 "${mpi[@]}" -np 4 "$tool" check 2>&1)
  echo "$out"
  grep -qF "$chose (TD_HIERARCHICAL=auto, 2 nodes of 2): found in" <<<"$out" ||
    fail "check: not the cached choice '$chose'"
  grep -qF "from the cache $path_file" <<<"$out" || fail "check: the path was not read back"
  "$tool" clear | grep -qE "removed [0-9]+ entr" || fail "clear: no report"
  [[ ! -e $path_file ]] || fail "clear left the path entry"
else
  grep -qE "NOT cached: (the machine looks busy|[0-9] of 3 passes)" <<<"$lines" ||
    fail "path measure: neither cached nor a reason why not"
fi

step "measure needs 2 ranks or more"
status=0
out=$("${mpi[@]}" -np 1 "$tool" measure 2>&1) || status=$?
echo "$out"
[[ $status -ne 0 ]] || fail "measure at 1 rank succeeded"
grep -qF "2 ranks or more" <<<"$out" || fail "measure at 1 rank: no explanation"
echo "check_td_autotune: ok"
