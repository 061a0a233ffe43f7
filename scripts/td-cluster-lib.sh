# Shared by td-cluster and td-cluster-agent (sourced, not run). Names, addresses and the Open MPI
# settings of the namespace cluster.
# shellcheck shell=bash

TD_PREFIX=${TD_CLUSTER_PREFIX:-td}
[[ $TD_PREFIX =~ ^[a-z][a-z0-9]{0,7}$ ]] ||
  { echo "td-cluster: TD_CLUSTER_PREFIX must be 1-8 lower-case letters/digits" >&2; exit 2; }
TD_NET=10.77.0           # host i is $TD_NET.i
TD_PREFIXLEN=24
TD_SUBNET=$TD_NET.0/$TD_PREFIXLEN

td_warn() { echo "td-cluster: $*" >&2; }
td_die() { echo "td-cluster: $*" >&2; exit 1; }

td_require_root() {
  [[ $(id -u) -eq 0 ]] || td_die "needs root (network and UTS namespaces)"
}

# Our namespaces: the bridge and the hosts, nothing else.
td_list_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${TD_PREFIX}-(br|h[0-9]+)\$" || true
}
td_list_hosts() {
  td_list_namespaces | grep -E -- '-h[0-9]+$' | sort -t h -k2 -n || true
}

td_ns_of_index() { echo "${TD_PREFIX}-h$1"; }
td_addr_of_index() { echo "$TD_NET.$1"; }

# h3, td-h3, 10.77.0.3, user@td-h3 -> td-h3
td_ns_of_host() {
  local h=${1##*@}
  h=${h%%:*}
  if [[ $h =~ ^h([0-9]+)$ || $h =~ ^${TD_PREFIX}-h([0-9]+)$ ]]; then
    echo "${TD_PREFIX}-h${BASH_REMATCH[1]}"
  elif [[ $h == "$TD_NET".* && ${h##*.} =~ ^[0-9]+$ ]]; then
    echo "${TD_PREFIX}-h${h##*.}"
  else
    td_die "unknown host '$1' (expected h<i>, ${TD_PREFIX}-h<i> or $TD_NET.<i>)"
  fi
}

td_require_host() {
  [[ -e /run/netns/$1 ]] || td_die "host $1 does not exist (td-cluster up N first)"
}

# Can namespace $1 reach address $2? A connection to a closed port is refused at once by a
# reachable peer; an unreachable one times out.
td_probe() {
  local out
  out=$(ip netns exec "$1" timeout 2 bash -c "exec 3<>/dev/tcp/$2/9" 2>&1) && return 0
  [[ $out == *refused* ]]
}

# The environment of `td-cluster run`: Open MPI starts its daemons with our agent and talks
# TCP only, on the cluster's subnet.
td_mpi_env() {
  TD_MPI_ENV=(
    "TD_CLUSTER_PREFIX=$TD_PREFIX"
    "OMPI_MCA_plm_rsh_agent=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/td-cluster-agent"
    "OMPI_MCA_plm_rsh_no_tree_spawn=1"
    "OMPI_MCA_pml=ob1"
    "OMPI_MCA_btl=self,tcp"
    "OMPI_MCA_btl_tcp_if_include=$TD_SUBNET"
    "OMPI_MCA_oob_tcp_if_include=$TD_SUBNET"
    "OMPI_MCA_rmaps_base_oversubscribe=1"
    # Every host sees all of this machine's cores and would bind its first rank to core 0:
    # ranks of different hosts would then share one core and take turns every scheduler tick.
    "OMPI_MCA_hwloc_base_binding_policy=none"
  )
  if [[ $(id -u) -eq 0 ]]; then
    TD_MPI_ENV+=("OMPI_ALLOW_RUN_AS_ROOT=1" "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
  fi
}
