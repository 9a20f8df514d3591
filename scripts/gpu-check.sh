#!/usr/bin/env bash
# On a GPU host that has PyTorch and no Rust, from the kit scripts/gpu-kit.sh built:
#   gpu-kit/scripts/gpu-check.sh [OUT_DIR]
# Finds the host's libtorch from its python3 (or $PYTHON), points the kit's binaries at it,
# and runs every check of the CUDA path (scripts/gpu_check.py): the CUDA-gated tests (a real
# CUDA OOM recovered among them), the allocator settings, the memory snapshot of a CUDA OOM
# (read by the host's torch.cuda._memory_viz), `import oomguard` (the kit's wheel) recovering a
# real CUDA OOM in a plain loop, oomguard's memory stats and the planner
# against the host's PyTorch, syncs per step (oomguard's read counter against CUDA's
# sync-debug mode), a 1-rank NCCL group, GPT-2 124M throughput, MFU and peak memory with
# model.loss full and fused next to eager PyTorch, and the largest micro-batch that fits the
# card with each.
# Writes OUT_DIR/gpu-check.json (results) and OUT_DIR/gpu-check.log (everything printed).
# GPU_CHECK_PARTS=tests,python,... runs some of the parts only (gpu_check.py's PARTS); the
# timed parts (overlap, throughput, fit) want the GPU to themselves.
set -euo pipefail
KIT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$KIT/gpu-check-out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
TORCH_LIB="$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OOMGUARD_BIN="$KIT/bin/oomguard" OOMGUARD_ROOT="$KIT"
# Python models (bin/oomguard-torch-python): the host's libpython and the site-packages its
# torch is in.
PY_LIB="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_vars().get("LIBDIR") or "")')"
export LD_LIBRARY_PATH="$LD_LIBRARY_PATH${PY_LIB:+:$PY_LIB}"
OOMGUARD_SITE_PACKAGES="$(dirname "$TORCH_LIB")/.." && OOMGUARD_SITE_PACKAGES="$(cd "$OOMGUARD_SITE_PACKAGES" && pwd)"
export OOMGUARD_SITE_PACKAGES
echo "gpu-check: kit $KIT, libtorch $TORCH_LIB, results in $OUT" >&2
"$PY" "$KIT/scripts/gpu_check.py" check "$KIT" "$OUT" 2>&1 | tee "$OUT/gpu-check.log"
echo "gpu-check: wrote $OUT/gpu-check.json" >&2
