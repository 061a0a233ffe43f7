#!/usr/bin/env bash
# Builds an outside program that gets tensordict-mpi through FetchContent, with the very
# CMakeLists.txt docs/getting-started.md shows (the block after "<!-- snippet: fetchcontent -->"),
# fetching this repository's current commit through a file:// URL into a temporary directory.
# The program runs at 2 ranks and must print "consumer ok". Registered as CTest test
# consumer.fetchcontent. It builds what is committed (HEAD), not uncommitted changes.
#   usage: test/consumer/fetchcontent/run.sh
# Honours CMAKE_COMMAND, MPIEXEC and CXX from the environment. Exit code 77 (skipped) outside a
# git checkout.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$(cd "$here/../../.." && pwd)
cmake_cmd=${CMAKE_COMMAND:-cmake}
mpiexec=${MPIEXEC:-mpirun}

if ! commit=$(git -C "$src" rev-parse --verify HEAD 2>/dev/null); then
  echo "run.sh: $src is not a git checkout; nothing to fetch (skipped)"
  exit 77
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/td_fetchcontent.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/app"
"$here/../snippet.sh" "$src/docs/getting-started.md" fetchcontent >"$tmp/app/CMakeLists.txt"
cp "$here/../consumer.cpp" "$tmp/app/app.cpp"
echo "== CMakeLists.txt (from docs/getting-started.md)"
cat "$tmp/app/CMakeLists.txt"

echo "== configure: fetch file://$src at $commit"
# No build type, as the commands docs/getting-started.md shows (unoptimised: 92 against 109 s
# with Release here, for what this test checks: the fetch, the build and the link).
"$cmake_cmd" -S "$tmp/app" -B "$tmp/build" \
  -DTENSORDICT_REPOSITORY="file://$src" -DTENSORDICT_VERSION="$commit"
fetched=$(git -C "$tmp/build/_deps/tensordict-src" rev-parse HEAD)
if [[ $fetched != "$commit" ]]; then
  echo "run.sh: FetchContent checked out $fetched, not $commit" >&2
  exit 1
fi
echo "== build"
"$cmake_cmd" --build "$tmp/build" -j "${JOBS:-2}"
echo "== run at 2 ranks"
output=$("$mpiexec" --allow-run-as-root --oversubscribe -np 2 "$tmp/build/app")
printf '%s\n' "$output"
if ! grep -qx 'consumer ok' <<<"$output"; then
  echo "run.sh: 'consumer ok' missing from the output" >&2
  exit 1
fi
echo "== consumer.fetchcontent passed"
