#!/usr/bin/env bash
# Prints the fenced code block that follows the line "<!-- snippet: NAME -->" in a Markdown
# page: how the tests run the commands and files the documentation shows, exactly as shown.
# Fails if the page has no such block.
#   usage: test/consumer/snippet.sh <page.md> <name>
set -euo pipefail
page=${1:?usage: snippet.sh <page.md> <name>}
name=${2:?usage: snippet.sh <page.md> <name>}
block=$(awk -v marker="<!-- snippet: $name -->" '
  !found && index($0, marker) == 1 { found = 1; next }
  found && /^```/ { if (inside) exit; inside = 1; next }
  inside { print }' "$page")
if [[ -z $block ]]; then
  echo "snippet.sh: no code block after '<!-- snippet: $name -->' in $page" >&2
  exit 1
fi
printf '%s\n' "$block"
