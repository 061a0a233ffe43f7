#!/usr/bin/env bash
# Runs test_mpi_divergence once per kind of divergence (TD_DIVERGENCE_KINDS=<kind>), so that a kind
# that hangs (the test's watchdog then ends the job) does not hide the others, and prints one line
# per kind and rank count: the outcome classes of its rounds, FAILED rounds, or HANG.
#
#   test/divergence/run_kinds.sh build/bin/test_mpi_divergence [ranks...]    (default ranks: 2 3)
#
# TD_DIVERGENCE_ROUNDS (default here 260: ten rounds of each kind) and TD_DIVERGENCE_SEED pass
# through; MPIEXEC (default mpiexec) and MPIEXEC_FLAGS (default --oversubscribe
# --allow-run-as-root) choose the launcher. Full logs: $LOG_DIR (default a temporary directory).
set -u
prog=${1:?usage: run_kinds.sh <test_mpi_divergence> [ranks...]}
shift
ranks=("$@")
[ ${#ranks[@]} -eq 0 ] && ranks=(2 3)
mpiexec=${MPIEXEC:-mpiexec}
read -r -a flags <<<"${MPIEXEC_FLAGS:---oversubscribe --allow-run-as-root}"
log_dir=${LOG_DIR:-$(mktemp -d)}
mkdir -p "$log_dir"
export TD_DIVERGENCE_ROUNDS=${TD_DIVERGENCE_ROUNDS:-260}
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1

kinds=$(TD_DIVERGENCE_KINDS=list "$mpiexec" "${flags[@]}" -n 1 "$prog" 2>/dev/null | grep -E '^[a-z0-9_]+$')
[ -n "$kinds" ] || { echo "run_kinds.sh: could not list the kinds from $prog" >&2; exit 2; }
status=0
for n in "${ranks[@]}"; do
  for kind in $kinds; do
    log="$log_dir/$kind.${n}ranks.log"
    TD_DIVERGENCE_KINDS=$kind timeout 600 "$mpiexec" "${flags[@]}" -n "$n" "$prog" >"$log" 2>&1
    line=$(grep -E "^  $kind +[0-9]+ x " "$log" | sed -E "s/^  $kind +//")
    if grep -q "stuck for" "$log"; then
      line="HANG: $(grep -m1 -o 'round seed [0-9]*' "$log") ($(grep -m1 -o 'stuck for [0-9]* s [a-z ]*' "$log"))"
    elif [ -z "$line" ]; then
      line="no summary (crashed?), see $log"
    fi
    if grep -q "FAILED" <<<"$line"; then
      line="$line  seeds: $(grep -o 'round seed [0-9]*' "$log" | sort -u | grep -o '[0-9]*$' | tr '\n' ' ')"
    fi
    case $line in *FAILED* | HANG* | "no summary"*) status=1 ;; esac
    printf '%d ranks  %-16s %s\n' "$n" "$kind" "$line"
  done
done
echo "logs: $log_dir"
exit $status
