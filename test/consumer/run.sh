#!/usr/bin/env bash
# Installs a build tree into a temporary prefix and builds test/consumer/consumer.cpp against it
# twice, the two ways users do: find_package(TensorDict CONFIG) and pkg-config. Each build runs
# at 2 ranks and must print "consumer ok". Registered as CTest test consumer.install.
#   usage: test/consumer/run.sh <build dir> [config]
# Honours CMAKE_COMMAND, MPIEXEC, MPICXX and CXX from the environment.
set -euo pipefail

build_dir=$(cd "${1:?usage: run.sh <build dir> [config]}" && pwd)
config=${2:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cmake_cmd=${CMAKE_COMMAND:-cmake}
mpiexec=${MPIEXEC:-mpirun}
mpicxx=${MPICXX:-mpicxx}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/td_consumer.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

step() { printf '\n== %s\n' "$*"; }

# Runs a consumer binary at 2 ranks and checks that it reports success.
run_consumer() {
  local output
  output=$("$mpiexec" --allow-run-as-root --oversubscribe -np 2 "$@")
  printf '%s\n' "$output"
  if ! grep -qx 'consumer ok' <<<"$output"; then
    echo "run.sh: 'consumer ok' missing from the output of $*" >&2
    return 1
  fi
}

step "install $build_dir into $prefix"
"$cmake_cmd" --install "$build_dir" --prefix "$prefix" ${config:+--config "$config"}

step "find_package(TensorDict) build"
"$cmake_cmd" -S "$here" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_TYPE="${config:-Release}"
"$cmake_cmd" --build "$tmp/cmake-build" ${config:+--config "$config"}
consumer=$(find "$tmp/cmake-build" -type f -name consumer -perm -u+x -print -quit)
run_consumer "$consumer"

step "pkg-config build"
pc_file=$(find "$prefix" -name tensordict.pc -print -quit)
if [[ -z $pc_file ]]; then
  echo "run.sh: tensordict.pc was not installed" >&2
  exit 1
fi
pc_dir=$(dirname "$pc_file")
libdir=$(dirname "$pc_dir")
pc_flags=$(PKG_CONFIG_PATH="$pc_dir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}" \
  pkg-config --cflags --libs tensordict)
echo "pkg-config --cflags --libs tensordict: $pc_flags"
# shellcheck disable=SC2086  # pc_flags is a list of words
"$mpicxx" -std=c++20 "$here/consumer.cpp" -o "$tmp/consumer_pc" $pc_flags
LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  run_consumer -x LD_LIBRARY_PATH "$tmp/consumer_pc"

step "consumer.install passed"
