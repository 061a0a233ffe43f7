#!/usr/bin/env bash
# Installs a build tree into a temporary prefix and builds test/consumer/consumer.cpp against it
# the two ways users do: find_package(TensorDict CONFIG), and pkg-config with the very commands
# README.md and docs/getting-started.md give (the fenced block after their
# "<!-- snippet: pkg-config -->" line, with /opt/td replaced by the temporary prefix and Open MPI's
# root and oversubscription flags added to mpirun). Each build runs at 2 ranks and must print
# "consumer ok". Registered as CTest test consumer.install.
#   usage: test/consumer/run.sh <build dir> [config]
# Honours CMAKE_COMMAND, MPIEXEC, MPICXX and CXX from the environment.
set -euo pipefail

build_dir=$(cd "${1:?usage: run.sh <build dir> [config]}" && pwd)
config=${2:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$(cd "$here/../.." && pwd)
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

step "installed td-autotune runs (it finds the installed library)"
if [[ -e $prefix/bin/td-autotune ]]; then
  TD_CACHE_DIR="$tmp/cache" "$prefix/bin/td-autotune" show
fi

step "find_package(TensorDict) build"
"$cmake_cmd" -S "$here" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_TYPE="${config:-Release}"
"$cmake_cmd" --build "$tmp/cmake-build" ${config:+--config "$config"}
consumer=$(find "$tmp/cmake-build" -type f -name consumer -perm -u+x -print -quit)
run_consumer "$consumer"

# The pkg-config commands of the pages users read, run as written: they must compile app.cpp,
# link it so that it finds libtensordict.so.0 at launch (no LD_LIBRARY_PATH is set here), and run.
if [[ ! -f $prefix/lib/pkgconfig/tensordict.pc ]]; then
  echo "run.sh: $prefix/lib/pkgconfig/tensordict.pc was not installed (the pages say lib/)" >&2
  exit 1
fi
for page in README.md docs/getting-started.md; do
  step "pkg-config build, as $page writes it"
  block=$("$here/snippet.sh" "$src/$page" pkg-config)
  script=$(sed -e "s#/opt/td#$prefix#g" -e "s#^mpicxx #$mpicxx #" \
    -e "s#^mpirun #$mpiexec --allow-run-as-root --oversubscribe #" <<<"$block")
  printf '%s\n' "$script"
  rm -rf "$tmp/pc" && mkdir "$tmp/pc" && cp "$here/consumer.cpp" "$tmp/pc/app.cpp"
  output=$(cd "$tmp/pc" && bash -euo pipefail -c "$script")
  printf '%s\n' "$output"
  if ! grep -qx 'consumer ok' <<<"$output"; then
    echo "run.sh: the pkg-config commands of $page did not print 'consumer ok'" >&2
    exit 1
  fi
done

step "consumer.install passed"
