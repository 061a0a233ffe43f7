#!/usr/bin/env bash
# `make install`'s build tree builds only what is installed: configures it (`make
# configure-install`) in a temporary directory and checks that its targets are the library and
# td-autotune, with no test, benchmark or example, and that the install prefix is PREFIX.
# Registered as CTest test consumer.library_only (a configure, no build: seconds).
#   usage: test/consumer/library_only.sh
# Honours CMAKE_COMMAND from the environment.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$(cd "$here/../.." && pwd)
cmake_cmd=${CMAKE_COMMAND:-cmake}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/td_library_only.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

make -C "$src" --no-print-directory configure-install CMAKE="$cmake_cmd" \
  INSTALL_BUILD_DIR="$tmp/build" PREFIX="$tmp/prefix" >/dev/null
targets=$("$cmake_cmd" --build "$tmp/build" --target help | sed -n 's/^\.\.\. \([^ ]*\).*/\1/p')
fail=0
for want in tensordict td-autotune install; do
  grep -qx "$want" <<<"$targets" || { echo "library_only.sh: target '$want' missing" >&2; fail=1; }
done
unwanted=$(grep -E '^(test_|bench_|td_bench|td_catch|fault_|compile_fail|example|train_|reduce_)' \
  <<<"$targets" || true)
if [[ -n $unwanted ]]; then
  echo "library_only.sh: the library-only tree would also build:" >&2
  echo "$unwanted" >&2
  fail=1
fi
prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$tmp/build/CMakeCache.txt")
if [[ $prefix != "$tmp/prefix" ]]; then
  echo "library_only.sh: CMAKE_INSTALL_PREFIX is '$prefix', not PREFIX ($tmp/prefix)" >&2
  fail=1
fi
if [[ $fail -ne 0 ]]; then
  printf 'targets:\n%s\n' "$targets" >&2
  exit 1
fi
echo "library-only install tree: $(wc -l <<<"$targets") targets, only the installed ones: ok"
