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
# Where the tests ran comes from their runs' step records: guard.rs trained on the CPU, and
# cuda_guard.rs, without CUDA, trained nothing; neither counts as a CUDA test here.
assert not any(v["ran_on_cuda"] for v in tests.values()), tests
assert tests["test guard"]["devices"] == ["cpu"], tests["test guard"]
assert tests["test cuda_guard"]["devices"] == [] and tests["test cuda_guard"]["results"], tests["test cuda_guard"]
assert set(tests["test guard"]["results"].values()) == {"ok"}, tests["test guard"]["results"]
assert "CUDA is not available" in r["note"], r
# The kit's Python models, against this torch and Python on the CPU.
py = r["checks"]["python model: an OOM inside a Python forward recovered"]
assert py["ok"] is True and py["device"] == "cpu", py
print("gpu-kit-test: gpu-check.sh ran", ", ".join(tests), "on the CPU:", r["note"], file=sys.stderr)
PY
# The kit's wheel bundles its command, and its tag covers that command's glibc floor.
WHEEL="$(ls "$KIT"/python/oomguard-*.whl)"
"$VENV/bin/python" -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("oomguard/_bin/oomguard"))' "$WHEEL" > "$TMP/bundled" || fail "$WHEEL bundles no oomguard/_bin/oomguard"
cmp -s "$TMP/bundled" "$KIT/bin/oomguard" || fail "$WHEEL's oomguard/_bin/oomguard is not the kit's bin/oomguard"
NEED="$("$ROOT/scripts/manylinux-tag.sh" "$TMP/bundled")"
case "$(basename "$WHEEL")" in *"-$NEED"_*) ;; *) fail "$WHEEL is not tagged $NEED, its command's glibc floor";; esac
echo "gpu-kit-test: $(basename "$WHEEL") bundles the kit's command ($NEED)" >&2
# The MFU table tells apart cards that share a name's prefix, and leaves out what it lacks.
for want in "H100 SXM:NVIDIA H100 80GB HBM3:85031714816" "H100 PCIe:NVIDIA H100 PCIe:85031714816" "H100 NVL:NVIDIA H100 NVL:99857989632" \
            "A100 40GB:NVIDIA A100-SXM4-40GB:42298834944" "L40S:NVIDIA L40S:47697362944" "L4:NVIDIA L4:23580639232" "none:NVIDIA A10G:23609475072"; do
  IFS=: read -r label name bytes <<< "$want"
  got="$("$VENV/bin/python" "$KIT/scripts/gpu_check.py" peak "$name" "$bytes" | "$VENV/bin/python" -c 'import json,sys; p=json.load(sys.stdin); print(p["label"] if p else "none")')"
  [ "$got" = "$label" ] || fail "gpu_check.py peak '$name': $got, expected $label"
done
echo "gpu-kit-test: ok ($(du -sh "$KIT" | cut -f1) kit)" >&2
