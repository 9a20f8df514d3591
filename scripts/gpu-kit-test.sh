#!/usr/bin/env bash
# The GPU kit's CPU half, here: builds gpu-kit/ (scripts/gpu-kit.sh) and checks that its
# binaries load the kit's torch libraries (not the set-up's), train the demo for 3 steps on
# the CPU, and that scripts/gpu-check.sh runs against that torch as on a host (its CUDA
# checks skipped, saying so). `make gpu-kit-test`; CI runs it after `make test`.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=versions.env
. "$ROOT/scripts/versions.env"
VERSION="${1:-$GPU_KIT_DEFAULT_TORCH}"
"$ROOT/scripts/gpu-kit.sh" "$VERSION"
VENV="$("$ROOT/scripts/setup.sh" --torch "$VERSION")"
KIT="$ROOT/gpu-kit"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fail() { echo "gpu-kit-test: FAILED: $*" >&2; exit 1; }

# The host's torch, found as gpu-check.sh finds it: from its python.
TORCH_LIB="$("$VENV/bin/python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
LOADED="$(LD_LIBRARY_PATH="$TORCH_LIB" ldd "$KIT/bin/oomguard-torch" | awk '/libtorch_cpu.so/ {print $3}')"
[ "$(readlink -f "$LOADED")" = "$(readlink -f "$TORCH_LIB/libtorch_cpu.so")" ] || fail "oomguard-torch loads libtorch_cpu.so from '$LOADED', not $TORCH_LIB"
echo "gpu-kit-test: oomguard-torch loads $LOADED" >&2

(cd "$TMP" && LD_LIBRARY_PATH="$TORCH_LIB" OOMGUARD_CACHE="$TMP/cache" OMP_NUM_THREADS=2 \
  "$KIT/bin/oomguard" train "$KIT/configs/demo.yaml" --max-steps 3 --run-dir "$TMP/run") || fail "the demo did not train"
STEPS="$(grep -c '"event":"step"' "$TMP/run/metrics.jsonl")"
[ "$STEPS" = 3 ] || fail "expected 3 step records, found $STEPS"
grep -q '"event":"oom"' "$TMP/run/metrics.jsonl" || fail "the demo's OOM at step 0 was not recorded"
echo "gpu-kit-test: the demo trained 3 steps against torch $VERSION, its OOM recovered" >&2

PYTHON="$VENV/bin/python" "$KIT/scripts/gpu-check.sh" "$TMP/out" > "$TMP/check.log" 2>&1 || { cat "$TMP/check.log"; fail "gpu-check.sh failed"; }
"$VENV/bin/python" - "$TMP/out/gpu-check.json" "$VERSION" <<'PY' || fail "gpu-check.json is not as expected"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["host"]["torch"].startswith(sys.argv[2]), r["host"]
tests = {k: v for k, v in r["checks"].items() if k.startswith("test ")}
assert len(tests) == 2 and all(v["ok"] for v in tests.values()), tests
assert "CUDA is not available" in r["note"], r
print("gpu-kit-test: gpu-check.sh ran", ", ".join(tests), "on the CPU:", r["note"], file=sys.stderr)
PY
echo "gpu-kit-test: ok ($(du -sh "$KIT" | cut -f1) kit)" >&2
