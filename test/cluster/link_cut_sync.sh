#!/usr/bin/env bash
# Cuts a host's link, again and again, under a loop of *sync* collectives (cluster_fault_loop
# --sync), and checks that every job ends, with the error printed, in bounded time: the sync
# data phase is a blocking MPI call that no timeout interrupts, so a cut that falls inside it is
# ended by the library's watchdog; a cut that falls between two calls meets the next call's
# agreement, which throws td::TimeoutError.
#
#   link_cut_sync.sh REPS VICTIM HOSTS RANKS TIMEOUT_MS PAUSE_MS BOUND_S -- PROGRAM [ARGS]
#
# Each of the REPS repetitions is a fresh job: PROGRAM runs at RANKS ranks on HOSTS (mpirun's
# --host list, --map-by node) with --sync --timeout-ms TIMEOUT_MS; once its loop runs, a random
# delay, then VICTIM's link goes down. Every rank on the other hosts (a survivor) must print,
# within TIMEOUT_MS + pause + 5 s of the cut, either
#   - its verdict "cluster fault: rank R on HOST: TimeoutError in the agreement ...: ok" (the cut
#     fell outside the data phase: every leaf still holds its old value), or
#   - the watchdog's "[td rank R] aborting the job: td::TimeoutError: ... the watchdog ends the
#     job" (the cut fell inside a blocking MPI call of the data phase),
# and every rank of the job, the victim's included, must have ended within BOUND_S s of the cut.
# The link then comes back and mpirun must end, non-zero, within 60 s (it cannot finish an abort
# while a host is unreachable). Odd repetitions run the program with --pause-ms 0 (a step is
# almost all data phase), even ones with --pause-ms PAUSE_MS (a step is mostly the pause between
# two calls, so the cut mostly meets an agreement); the test fails unless both phases were hit.
# The first repetition that hangs or ends badly fails the test, with its output.
# Whatever happens, the hosts are left without processes and with their links up.
set -uo pipefail
if [[ $# -lt 9 || $8 != -- ]]; then
  sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
  exit 2
fi
reps=$1 victim=$2 hosts=$3 ranks=$4 timeout_ms=$5 pause_ms=$6 bound_s=$7
shift 8
program=("$@")
cluster=${TD_CLUSTER:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../scripts" && pwd)/td-cluster}
[[ $victim =~ ^h[0-9]+$ ]] || { echo "VICTIM: expected h<i>, got '$victim'" >&2; exit 2; }
victim_name=${TD_CLUSTER_PREFIX:-td}-$victim
comm=$(basename "${program[0]}")
comm=${comm:0:15}   # the kernel keeps 15 characters of a process name

now_ms() { echo $(($(date +%s%N) / 1000000)); }
out=$(mktemp)
pid=""
all_hosts=$(tr ',' '\n' <<<"$hosts" | sed 's/:.*//' | sort -u)
cleanup() {
  "$cluster" link "$victim" up >/dev/null 2>&1
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null; fi
  local h
  for h in $all_hosts; do "$cluster" kill "$h" >/dev/null 2>&1; done
}
trap 'cleanup; rm -f "$out"' EXIT
processes() {
  local h p
  for h in $all_hosts; do
    for p in $(ip netns pids "$h" 2>/dev/null); do
      echo "$h: $(ps -o pid=,stat=,wchan:20=,etime=,args= -p "$p" | cut -c1-160)"
    done
  done
}
fail() {
  echo "---- output of repetition $rep ----"
  cat "$out"
  echo "---- processes on the hosts ----"
  processes
  echo "----------------"
  echo "FAIL (repetition $rep of $reps): $*"
  exit 1
}
# The program's ranks still running on the cluster's hosts.
ranks_alive() {
  local h p n=0
  for h in $all_hosts; do
    for p in $(ip netns pids "$h" 2>/dev/null); do
      [[ $(cat "/proc/$p/comm" 2>/dev/null) == "$comm" ]] && n=$((n + 1))
    done
  done
  echo "$n"
}
# What survivor rank $1 printed: "agreement", "data", "FAILED" or nothing.
outcome() {
  if grep -qE "cluster fault: rank $1 on [^:]*: TimeoutError in the agreement .*: FAILED" "$out"; then
    echo FAILED
  elif grep -qE "cluster fault: rank $1 on [^:]*: TimeoutError in the agreement .*: ok$" "$out"; then
    echo agreement
  elif grep -qE "\[td rank $1\] aborting the job: td::TimeoutError: .*the watchdog ends the job" \
    "$out"; then
    echo data
  fi
}

hit_agreement=0 hit_data=0 rep=0
declare -a durations=()
suite_start=$(now_ms)
for ((rep = 1; rep <= reps; rep++)); do
  pause=$((rep % 2 == 1 ? 0 : pause_ms))
  : >"$out"
  for h in $all_hosts; do "$cluster" kill "$h" >/dev/null 2>&1; done
  start=$(now_ms)
  "$cluster" run -- mpirun -np "$ranks" --host "$hosts" --map-by node "${program[@]}" \
    --sync --timeout-ms "$timeout_ms" --pause-ms "$pause" >"$out" 2>&1 &
  pid=$!

  # 1. The loop is under way, and we know where every rank runs.
  until grep -q "cluster fault: loop running" "$out" &&
    (($(grep -c "cluster fault: rank [0-9]* runs on " "$out") >= ranks)); do
    kill -0 "$pid" 2>/dev/null || fail "the job ended before its loop was running"
    (($(now_ms) - start < 90000)) || fail "the loop was not running after 90 s"
    sleep 0.1
  done
  survivors=$(grep -oE "cluster fault: rank [0-9]+ runs on [^ ]+" "$out" |
    awk -v v="$victim_name" '$7 != v {print $4}' | sort -n | paste -sd' ')
  [[ -n $survivors ]] || fail "no rank runs outside $victim_name"

  # 2. A random moment (0.3-1.3 s later, in steps of a few tens of ms), into a healthy job.
  delay=$((300 + RANDOM % 1000))
  sleep "$(printf '%d.%03d' $((delay / 1000)) $((delay % 1000)))"
  kill -0 "$pid" 2>/dev/null || fail "the job ended before the fault"
  grep -qE "cluster fault: rank [0-9]+ on |aborting the job" "$out" &&
    fail "a rank gave up before the fault"
  fault=$(now_ms)
  "$cluster" link "$victim" down || fail "could not take $victim's link down"

  # 3. Every survivor prints its error: the agreement's TimeoutError or the watchdog's.
  # (The call that meets the cut began before it, or after the pause; mpirun forwards the
  # output of the ranks on its own host up to 2 s late while it handles an abort.)
  report_bound=$((timeout_ms + pause + 5000))
  declare -A seen=()
  while :; do
    missing=0
    for r in $survivors; do
      [[ -n ${seen[$r]:-} ]] && continue
      o=$(outcome "$r")
      if [[ -n $o ]]; then seen[$r]="$o +$(($(now_ms) - fault)) ms"; else missing=1; fi
    done
    ((missing == 0)) && break
    (($(now_ms) - fault < report_bound)) || break
    sleep 0.05
  done
  summary=""
  for r in $survivors; do
    summary+=" rank $r: ${seen[$r]:-nothing};"
  done
  for r in $survivors; do
    [[ -n ${seen[$r]:-} ]] || fail "rank $r printed no error within ${report_bound} ms of the cut:$summary"
    [[ ${seen[$r]} == FAILED* ]] && fail "rank $r's verdict is FAILED:$summary"
  done

  # 4. Every rank of the job ends (the victim's too: its own call times out the same way).
  while (($(ranks_alive) > 0)) && (($(now_ms) - fault < bound_s * 1000)); do sleep 0.1; done
  ((n = $(ranks_alive))) && fail "$n rank(s) still running ${bound_s} s after the cut:$summary"
  ended=$(($(now_ms) - fault))

  # 5. The link comes back; mpirun, which waits for the cut host's daemon, ends.
  "$cluster" link "$victim" up || fail "could not bring $victim's link up again"
  restored=$(now_ms)
  while kill -0 "$pid" 2>/dev/null && (($(now_ms) - restored < 60000)); do sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && fail "mpirun did not end within 60 s of the link coming back"
  wait "$pid"
  rc=$?
  pid=""
  ((rc != 0)) || fail "the job ended with status 0 after a fault"
  grep -q "FAILED" "$out" && fail "a rank reported a failure"
  phases=$(for r in $survivors; do echo "${seen[$r]%% *}"; done | sort -u | paste -sd'+')
  [[ $phases == *agreement* ]] && hit_agreement=$((hit_agreement + 1))
  [[ $phases == *data* ]] && hit_data=$((hit_data + 1))
  durations+=("$(($(now_ms) - start))")
  printf 'rep %d/%d: pause %d ms, cut %d ms after the launch:%s every rank ended +%d ms; mpirun ended %d ms after the link came back (status %d); rep %d ms\n' \
    "$rep" "$reps" "$pause" "$((fault - start))" "$summary" "$ended" \
    "$(($(now_ms) - restored))" "$rc" "${durations[-1]}"
  unset seen
done
rep=$reps
echo "phases hit: agreement in $hit_agreement repetition(s), data phase in $hit_data (of $reps; a repetition can hit both, one rank each); $(( ($(now_ms) - suite_start) / 1000 )) s in all"
((hit_agreement > 0)) || fail "no cut fell in an agreement"
((hit_data > 0)) || fail "no cut fell in a data phase"
echo "PASS"
