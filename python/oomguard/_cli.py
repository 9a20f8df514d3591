"""The `oomguard` command of the wheel: the launcher, sweeps and reports (the libtorch-free
binary that `make wheel` puts in oomguard/_bin/), run with the Python it was installed with.

Keeps: nothing is decided here. It only finds the binary, names this interpreter for the
workers (OOMGUARD_PYTHON, unless already set) and replaces itself with the binary."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BINARY = Path(__file__).with_name("_bin") / "oomguard"


def main() -> None:
    if BINARY.exists() and not os.access(BINARY, os.X_OK):
        sys.stderr.write(
            f"oomguard: {BINARY} is not executable (the installer dropped its mode): chmod +x {BINARY}\n"
        )
        sys.exit(2)
    if not BINARY.exists():
        sys.stderr.write(
            f"oomguard: this install has no command-line binary ({BINARY} is missing): it is a development "
            "build of the Python package; run ./target/release/oomguard from the repository, or install a wheel "
            "built by `make wheel` or `make gpu-kit` (docs/getting-started.md)\n"
        )
        sys.exit(2)
    os.environ.setdefault("OOMGUARD_PYTHON", sys.executable)
    os.execv(str(BINARY), ["oomguard", *sys.argv[1:]])


if __name__ == "__main__":
    main()
