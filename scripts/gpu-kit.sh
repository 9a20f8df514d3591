#!/usr/bin/env bash
# Builds oomguard for a GPU host's own PyTorch (a host with torch and no Rust toolchain):
#   scripts/gpu-kit.sh [TORCH_VERSION]      (default: GPU_KIT_DEFAULT_TORCH in versions.env)
# Installs that torch from PyPI into the set-up's cache (scripts/setup.sh --torch), builds a
# temporary copy of this tree against it with the matching tch (GPU_KIT_TORCH_<MAJOR>_<MINOR>
# in versions.env: the only place the map lives), and writes gpu-kit/ (git-ignored): the two
# binaries and the CUDA test binaries, stripped, configs/, scripts/gpu-check.sh, python/ (the
# `oomguard` Python package's wheel) and KIT.txt.
# Copy gpu-kit/ to the host and run gpu-kit/scripts/gpu-check.sh there.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=versions.env
. "$ROOT/scripts/versions.env"
VERSION="${1:-$GPU_KIT_DEFAULT_TORCH}"
MAP="GPU_KIT_TORCH_$(echo "$VERSION" | cut -d. -f1-2 | tr . _)"
TCH="${!MAP:-}"
if [ -z "$TCH" ]; then
  echo "gpu-kit: no tch release is known for torch $VERSION: add $MAP=<tch version> to scripts/versions.env" >&2
  exit 2
fi
CACHE="${OOMGUARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/oomguard}"
VENV="$("$ROOT/scripts/setup.sh" --torch "$VERSION")"
TORCH_DIR="$(ls -d "$VENV"/lib/python3*/site-packages/torch | head -n 1)"
WORK="$CACHE/gpu-kit-$VERSION"
SRC="$WORK/src"
# One kit build at a time per version: the copy and the target folder below are shared by
# every checkout on the machine, and a second build would replace the first's sources mid-build.
mkdir -p "$WORK"
exec 9>"$WORK.lock"
flock 9 || { echo "gpu-kit: cannot lock $WORK.lock" >&2; exit 1; }
# The copy: tracked and untracked-but-not-ignored files, as they are now, stamped now (-m):
# the target folder is shared by every checkout, and a file keeping its own older time would
# look unchanged to cargo against another checkout's newer build.
rm -rf "$SRC" && mkdir -p "$SRC"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done | tar --null -T - -cf -) | tar -C "$SRC" -xmf -
sed -i -E "s/^(tch|torch-sys) = \"[^\"]+\"/\1 = \"$TCH\"/" "$SRC/Cargo.toml"
grep -q "^tch = \"$TCH\"" "$SRC/Cargo.toml" || { echo "gpu-kit: could not set tch = $TCH in Cargo.toml" >&2; exit 1; }
TESTS=(cuda_guard guard)
echo "gpu-kit: building against torch $VERSION ($TORCH_DIR) with tch $TCH in $SRC" >&2
# The target folder persists between kits of one version: a rebuild is incremental.
export LIBTORCH="$TORCH_DIR" LIBTORCH_BYPASS_VERSION_CHECK=1 LIBTORCH_CXX11_ABI=1 CARGO_TARGET_DIR="$WORK/target"
# Without the `python` feature: the kit's binaries must not need the build machine's libpython.
(cd "$SRC" && cargo build --release --bins --no-default-features)
mapfile -t EXES < <(cd "$SRC" && cargo test --release --no-default-features --no-run "${TESTS[@]/#/--test=}" --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]: print(m["executable"])')
[ "${#EXES[@]}" -eq "${#TESTS[@]}" ] || { echo "gpu-kit: expected ${#TESTS[@]} test binaries, got ${#EXES[@]}" >&2; exit 1; }
KIT="$ROOT/gpu-kit"
rm -rf "$KIT" && mkdir -p "$KIT/bin" "$KIT/tests" "$KIT/scripts"
cp "$WORK/target/release/oomguard" "$WORK/target/release/oomguard-torch" "$KIT/bin/"
# Python models (model.kind: python): oomguard-torch-python, the same commands with CPython
# embedded, built against the kit venv's Python (its version in KIT.txt; its own target folder,
# so that neither build undoes the other's). It runs on a host whose torch runs under that
# Python; gpu-check.sh points it at the host's libpython and site-packages. GPU_KIT_PYTHON
# names another interpreter (a shared-library build) to embed: the host's Python version.
EMBED="${GPU_KIT_PYTHON:-$VENV/bin/python}"
PYVER="$("$EMBED" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" || { echo "gpu-kit: GPU_KIT_PYTHON=$EMBED does not run" >&2; exit 2; }
[ "$("$EMBED" -c 'import sysconfig; print(sysconfig.get_config_var("Py_ENABLE_SHARED"))')" = 1 ] ||
  { echo "gpu-kit: $EMBED has no shared libpython to embed: name a Python built with --enable-shared in GPU_KIT_PYTHON" >&2; exit 2; }
(cd "$SRC" && PYO3_PYTHON="$EMBED" CARGO_TARGET_DIR="$WORK/target-python-$PYVER" cargo build --release --bin oomguard-torch)
cp "$WORK/target-python-$PYVER/release/oomguard-torch" "$KIT/bin/oomguard-torch-python"
for e in "${EXES[@]}"; do cp "$e" "$KIT/tests/$(basename "$e" | sed 's/-[0-9a-f]*$//')"; done
strip "$KIT"/bin/* "$KIT"/tests/*
cp -r "$ROOT/configs" "$KIT/"
cp "$ROOT/scripts/gpu-check.sh" "$ROOT/scripts/gpu_check.py" "$KIT/scripts/"
mkdir -p "$KIT/examples" && cp -r "$ROOT/examples/python" "$KIT/examples/"
# `import oomguard`'s wheel (abi3, no libtorch linked: it works with the host's own torch),
# built with the set-up's maturin (TEST_PYTHON_PACKAGES) from the same copy of the tree.
"$ROOT/scripts/setup.sh" >&2
# The wheel's `oomguard` command is the kit's libtorch-free binary, as `make wheel` bundles it.
# Its tag carries that binary's glibc floor (scripts/manylinux-tag.sh), as `make wheel`'s does.
mkdir -p "$SRC/python/oomguard/_bin" && cp "$KIT/bin/oomguard" "$SRC/python/oomguard/_bin/oomguard"
TAG="$("$ROOT/scripts/manylinux-tag.sh" "$KIT/bin/oomguard")"
(cd "$SRC/python" && CARGO_TARGET_DIR="$WORK/python-target" "$CACHE/torch-$TORCH_VERSION/bin/maturin" build --release --quiet \
  --compatibility "$TAG" \
  -i "$CACHE/torch-$TORCH_VERSION/bin/python" -o "$KIT/python" >&2)
# The host's glibc must be at least the newest any of the binaries links.
FLOOR="$(for b in "$KIT"/bin/*; do "$ROOT/scripts/manylinux-tag.sh" "$b" 2>/dev/null || true; done | sort -V | tail -n 1)"
FLOOR="${FLOOR:-manylinux_2_17}"
printf 'oomguard %s, built %s for torch %s with tch %s; Python models for Python %s; needs glibc 2.%s or newer\n' "$(cd "$ROOT" && git describe --always --dirty)" "$(date -u +%Y-%m-%dT%H:%MZ)" "$VERSION" "$TCH" "$PYVER" "${FLOOR#manylinux_2_}" > "$KIT/KIT.txt"
echo "gpu-kit: $(du -sh "$KIT" | cut -f1) in $KIT: $(cat "$KIT/KIT.txt")" >&2
