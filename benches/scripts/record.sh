#!/usr/bin/env bash
# Runs `cargo bench --bench NAME` and keeps its output under docs/measurements/, headed by
# the date, the machine, the commit and the load, so a figure in docs/benchmarks.md can name its raw output:
#   benches/scripts/record.sh NAME      -> docs/measurements/bench-NAME-YYYY-MM-DD.txt
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
NAME="$1"
OUT="$ROOT/docs/measurements/bench-$NAME-$(date -u +%Y-%m-%d).txt"
mkdir -p "$(dirname "$OUT")"
{
  echo "# command: cargo bench --bench $NAME"
  echo "# date: $(date -u +%Y-%m-%dT%H:%MZ); commit: $(git -C "$ROOT" describe --always --dirty)"
  echo "# machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB; libtorch $(readlink -f "$ROOT/.libtorch" | grep -o 'torch-[0-9.]*' | head -n 1)"
  echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg) (on $(nproc) cores; above $(nproc) means other work shared the machine)"
  (cd "$ROOT" && cargo bench --bench "$NAME" 2>/dev/null)
  echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
cat "$OUT"
