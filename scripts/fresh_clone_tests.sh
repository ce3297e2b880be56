#!/usr/bin/env bash
# Run the README's test command on N fresh clones of HEAD, one after another; stop at the first failure.
# Usage: scripts/fresh_clone_tests.sh [N=20] [WORK_DIR=/tmp/miles-fresh-clones]
# Each clone gets its own .venv (uv's package cache is shared) and no .hypothesis/ or .pytest_cache/, as in CI.
set -euo pipefail
n="${1:-20}"
work="${2:-/tmp/miles-fresh-clones}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
commit="$(git -C "$repo" rev-parse HEAD)"
mkdir -p "$work"
log="$work/summary.txt"
echo "commit $commit, $n runs, started $(date -u +%FT%TZ)" | tee "$log"
for i in $(seq 1 "$n"); do
  clone="$work/clone-$i"
  rm -rf "$clone"
  git clone --quiet "$repo" "$clone"
  git -C "$clone" checkout --quiet "$commit"
  # ../shared must sit beside the clone, as beside the workspace checkout
  [ -e "$work/shared" ] || ln -s "$(cd "$repo/.." && pwd)/shared" "$work/shared"
  start=$(date +%s)
  if (cd "$clone" && uv sync --locked --quiet && uv run pytest > "$work/run-$i.log" 2>&1); then
    echo "run $i: passed in $(( $(date +%s) - start )) s: $(tail -1 "$work/run-$i.log")" | tee -a "$log"
    rm -rf "$clone"
  else
    echo "run $i: FAILED after $(( $(date +%s) - start )) s (clone kept at $clone): $(tail -1 "$work/run-$i.log")" | tee -a "$log"
    exit 1
  fi
done
echo "all $n runs passed, finished $(date -u +%FT%TZ)" | tee -a "$log"
