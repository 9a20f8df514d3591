"""Shared helpers: running tests/python/loop.py in real subprocesses (one process, or two Gloo
ranks on this machine), reading what they wrote."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

torch.set_num_threads(1)
# In-process guards never touch the user's micro-batch cache.
os.environ["OOMGUARD_CACHE"] = tempfile.mkdtemp(prefix="oomguard-test-cache-")

ROOT = Path(__file__).resolve().parents[2]
LOOP = Path(__file__).with_name("loop.py")


def env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """A child's environment: one thread, none of the launcher's variables, and a micro-batch
    cache of its own (a fresh folder) unless `extra` names one."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OOMGUARD_", "RANK", "WORLD_SIZE", "MASTER_"))}
    e["OMP_NUM_THREADS"] = "1"
    e["OOMGUARD_CACHE"] = tempfile.mkdtemp(prefix="oomguard-test-cache-")
    e.update(extra or {})
    return e


class Run:
    def __init__(self, code: int, out: str, seconds: float, params: Optional[List[torch.Tensor]]):
        self.code, self.out, self.seconds, self.params = code, out, seconds, params

    def train_s(self) -> float:
        """The training loop's time (after start-up), the slowest rank's."""
        return max(float(l.split()[1]) for l in self.out.splitlines() if l.startswith("train_s "))


def _finish(code: int, out: str, t0: float, out_file: Path) -> Run:
    params = torch.load(out_file) if code == 0 and out_file.exists() else None
    return Run(code, out, time.perf_counter() - t0, params)


def run_loop(tmp: Path, name: str, *args: str, extra_env: Optional[Dict[str, str]] = None) -> Run:
    """One process of loop.py."""
    out_file = tmp / f"{name}.pt"
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, str(LOOP), "--out", str(out_file), *args],
        env=env(extra_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    return _finish(p.returncode, p.stdout, t0, out_file)


def free_port() -> int:
    """A port free now, drawn in 10000..20000: below the kernel's ephemeral range, where any
    process's next outgoing connection could take a port the kernel handed out (binding port 0)
    before rank 0's store listens on it, and below the launcher's own draws (from 20000)."""
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(10000, 20000)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port


def run_ranks(
    tmp: Path,
    name: str,
    *args: str,
    extra_env: Optional[Dict[str, str]] = None,
    world: int = 2,
    script: Path = LOOP,
    timeout: float = 300,
    out_flag: bool = True,
) -> Run:
    """`world` Gloo ranks of `script` (loop.py) on this machine, started as torchrun would."""
    out_file = tmp / f"{name}.pt"
    port = str(free_port())
    t0 = time.perf_counter()
    procs = []
    cache = tempfile.mkdtemp(prefix="oomguard-test-cache-")
    for rank in range(world):
        e = env({"OOMGUARD_CACHE": cache, **(extra_env or {})})
        e.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *(["--out", str(out_file)] if out_flag else []), *args],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    code = 0
    for rank, p in enumerate(procs):
        try:
            o, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(f"--- rank {rank} (exit {p.returncode})\n{o}")
        code = code or p.returncode
    return _finish(code, "\n".join(outs), t0, out_file)


def launcher() -> Optional[Path]:
    """The `oomguard` binary: OOMGUARD_BIN, else this checkout's release build."""
    given = os.environ.get("OOMGUARD_BIN")
    if given:
        return Path(given)
    built = ROOT / "target" / "release" / "oomguard"
    return built if built.exists() else None


def records(run_dir: Path) -> List[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def max_diff(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Run:
    """The plain loop, one process, no cap, no guard: the parameters every run must equal."""
    tmp = tmp_path_factory.mktemp("reference")
    r = run_loop(tmp, "reference")
    assert r.code == 0, r.out
    return r
