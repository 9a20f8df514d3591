#!/usr/bin/env bash
# `make wheel`: the pip-installable front door, dist/oomguard-VERSION-*.whl: `import oomguard`
# (python/) and the `oomguard` command (launch, sweep, report: target/release/oomguard, the
# libtorch-free binary, stripped, in oomguard/_bin/). It depends on no torch: the user's own
# (>= 2.1) serves `import oomguard`, and the launcher runs workers with the Python the wheel is
# installed in. `train` and `plan` need oomguard-torch, a build of this repository.
# `scripts/wheel.sh [OUT_DIR]` (default dist/); `make build` first.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/dist}"
BIN="$ROOT/target/release/oomguard"
VENV="$ROOT/.venv"
[ -x "$BIN" ] || { echo "wheel: $BIN is missing: run \`make build\` first" >&2; exit 2; }
[ -x "$VENV/bin/maturin" ] || { echo "wheel: $VENV/bin/maturin is missing: run \`make setup\` first" >&2; exit 2; }
STAGE="$ROOT/python/oomguard/_bin"
# Never left behind: the dev wheel (scripts/setup.sh) must not carry a stale binary.
trap 'rm -rf "$STAGE"' EXIT
rm -rf "$STAGE"
mkdir -p "$STAGE" "$OUT"
strip -o "$STAGE/oomguard" "$BIN"
rm -f "$OUT"/oomguard-*.whl
# The wheel's glibc floor is the bundled binary's too (scripts/manylinux-tag.sh).
TAG="$("$ROOT/scripts/manylinux-tag.sh" "$STAGE/oomguard")"
(cd "$ROOT/python" && CARGO_TARGET_DIR="$ROOT/python/target" "$VENV/bin/maturin" build --release --quiet \
  --compatibility "$TAG" -i "$VENV/bin/python" -o "$OUT" >&2)
ls "$OUT"/oomguard-*.whl
