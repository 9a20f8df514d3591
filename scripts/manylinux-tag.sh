#!/usr/bin/env bash
# The manylinux tag a wheel bundling BINARY must carry: its glibc floor (the newest GLIBC_2.N
# symbol version it needs, 17 at least), since maturin audits only the extension. A host whose
# glibc is older then refuses the wheel at `pip install`, not the command at its first run.
#   scripts/manylinux-tag.sh BINARY   -> manylinux_2_N
set -euo pipefail
BIN="$1"
GLIBC="$(objdump -T "$BIN" | grep -o 'GLIBC_2\.[0-9]*' | sort -Vu | tail -n 1)"
[ -n "$GLIBC" ] || { echo "manylinux-tag: cannot read the glibc versions $BIN needs (objdump -T)" >&2; exit 2; }
MINOR="${GLIBC#GLIBC_2.}"
echo "manylinux_2_$(( MINOR > 17 ? MINOR : 17 ))"
