#!/usr/bin/env bash
# Breaks a host of the namespace cluster (scripts/td-cluster) in the middle of a loop of
# collectives run by cluster_fault_loop, and checks how the job ends.
#
#   fault_across_hosts.sh MODE VICTIM HOSTS RANKS SURVIVORS TIMEOUT_MS BOUND_S -- PROGRAM [ARGS]
#
# MODE link: VICTIM's link is taken down (from the bridge side, as a pulled cable). Every rank on
#   the other hosts (SURVIVORS of them) must print an "ok" verdict (td::TimeoutError, every leaf
#   wholly old or wholly new) within BOUND_S seconds of the fault, whose diagnosis lists exactly
#   VICTIM's ranks as not answering and every other rank as in this call. The link is then
#   restored,
#   and the job must end (the survivors' td::abort) within 60 s more.
# MODE kill: VICTIM's ranks are killed (SIGKILL). The job must end with a non-zero status within
#   BOUND_S seconds; any verdict printed meanwhile must be "ok".
# HOSTS is mpirun's --host list (td-h1:2,td-h2:2); the program gets --timeout-ms TIMEOUT_MS.
# Whatever happens, the hosts are left without processes and with their links up.
set -uo pipefail
if [[ $# -lt 9 || $8 != -- ]]; then
  sed -n '2,18s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
  exit 2
fi
mode=$1 victim=$2 hosts=$3 ranks=$4 survivors=$5 timeout_ms=$6 bound_s=$7
shift 8
program=("$@")
cluster=${TD_CLUSTER:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../scripts" && pwd)/td-cluster}

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
out=$(mktemp)
pid=""
all_hosts=$(tr ',' '\n' <<<"$hosts" | sed 's/:.*//' | sort -u)
cleanup() {
  [[ $mode == link ]] && "$cluster" link "$victim" up >/dev/null 2>&1
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null; fi
  local h
  for h in $all_hosts; do "$cluster" kill "$h" >/dev/null 2>&1; done
  rm -f "$out"
}
trap cleanup EXIT
fail() {
  echo "---- output ----"
  cat "$out"
  echo "---- processes on the hosts ----"
  local h p
  for h in $all_hosts; do
    for p in $(ip netns pids "$h" 2>/dev/null); do
      echo "$h: $(ps -o pid=,stat=,wchan:20=,etime=,args= -p "$p" | cut -c1-160)"
    done
  done
  echo "----------------"
  echo "FAIL: $*"
  exit 1
}

# Survivors are the ranks on hosts other than the victim; their verdicts name their host.
[[ $victim =~ ^h[0-9]+$ ]] || { echo "VICTIM: expected h<i>, got '$victim'" >&2; exit 2; }
victim_name=${TD_CLUSTER_PREFIX:-td}-$victim

start=$(now_ms)
"$cluster" run -- mpirun -np "$ranks" --host "$hosts" --map-by node "${program[@]}" \
  --timeout-ms "$timeout_ms" >"$out" 2>&1 &
pid=$!

# 1. The loop is under way on every host.
until grep -q "cluster fault: loop running" "$out"; do
  kill -0 "$pid" 2>/dev/null || fail "the job ended before its loop was running"
  (( $(now_ms) - start < 90000 )) || fail "the loop was not running after 90 s"
  sleep 0.1
done
sleep 0.5

# 2. The fault, into a healthy job: nobody has given up yet.
verdicts() { grep -E "cluster fault: rank [0-9]+ on " "$out" | grep -v " on $victim_name:" || true; }
kill -0 "$pid" 2>/dev/null || fail "the job ended before the fault"
grep -qE "cluster fault: rank [0-9]+ on " "$out" && fail "a rank gave up before the fault"
fault=$(now_ms)
if [[ $mode == link ]]; then
  "$cluster" link "$victim" down || fail "could not take $victim's link down"
  echo "fault: $victim's link down at +$((fault - start)) ms"
else
  "$cluster" kill "$victim" "$(basename "${program[0]}")"
  echo "fault: $victim's ranks killed at +$((fault - start)) ms"
fi

# 3. The outcome, within the bound.
if [[ $mode == link ]]; then
  while (( $(verdicts | wc -l) < survivors )); do
    kill -0 "$pid" 2>/dev/null || break
    (( $(now_ms) - fault < bound_s * 1000 )) || break
    sleep 0.05
  done
  seen=$(now_ms)
  n=$(verdicts | wc -l)
  (( n >= survivors )) ||
    fail "$n of $survivors surviving ranks reported within ${bound_s}s of the fault"
  echo "survivors: $n verdict(s) $((seen - fault)) ms after the fault (bound ${bound_s}s)"
  "$cluster" link "$victim" up || fail "could not bring $victim's link up again"
  restored=$(now_ms)
  while kill -0 "$pid" 2>/dev/null && (( $(now_ms) - restored < 60000 )); do sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && fail "the job did not end within 60 s of the link coming back"
  wait "$pid"
  rc=$?
  echo "job: ended with status $rc $(( $(now_ms) - restored )) ms after the link came back"
else
  while kill -0 "$pid" 2>/dev/null && (( $(now_ms) - fault < bound_s * 1000 )); do sleep 0.05; done
  kill -0 "$pid" 2>/dev/null && fail "the job did not end within ${bound_s}s of the kill"
  wait "$pid"
  rc=$?
  ended=$(now_ms)
  echo "job: ended with status $rc $((ended - fault)) ms after the kill (bound ${bound_s}s)"
  (( rc != 0 )) || fail "the job ended with status 0 after losing ranks"
fi
pid=""

cat "$out"
if grep -q "FAILED" "$out"; then fail "a rank reported a failure"; fi
bad=$(verdicts | grep -cv ': ok$' || true)
(( bad == 0 )) || fail "$bad verdict(s) not ok"
# A cut link: every survivor's diagnosis names exactly the cut host's ranks as not answering,
# and every other rank as in this call (the survivors all wait in the same step).
if [[ $mode == link ]]; then
  ranks_on() {  # ranks_on PATTERN: the ranks whose host matches, comma-separated
    grep -oE "cluster fault: rank [0-9]+ runs on $1\$" "$out" |
      grep -oE 'rank [0-9]+' | grep -oE '[0-9]+' | sort -n | paste -sd, -
  }
  expected=$(ranks_on "$victim_name")
  [[ -n $expected ]] || fail "no rank said it runs on $victim_name"
  others=$(grep -oE "cluster fault: rank [0-9]+ runs on .*" "$out" | grep -v " on $victim_name\$" |
    grep -oE 'rank [0-9]+' | grep -oE '[0-9]+' | sort -n | paste -sd, -)
  while read -r line; do
    silent=$(sed -nE 's/.*; no answer from ranks ([-?0-9,]+); in this call ranks [-0-9,]+: ok$/\1/p' <<<"$line")
    inside=$(sed -nE 's/.*; in this call ranks ([-0-9,]+): ok$/\1/p' <<<"$line")
    [[ $silent == "$expected" ]] ||
      fail "a survivor's diagnosis lists ranks '${silent:-(none)}' as not answering, expected" \
        "$expected (the ranks on $victim_name): $line"
    [[ $inside == "$others" ]] ||
      fail "a survivor's diagnosis lists ranks '${inside:-(none)}' in this call, expected" \
        "$others (the ranks not on $victim_name): $line"
  done < <(verdicts)
  echo "diagnosis: every survivor names ranks $expected (on $victim_name) as not answering" \
    "and ranks $others as in this call"
fi
echo "PASS"
