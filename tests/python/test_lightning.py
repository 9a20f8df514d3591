"""`oomguard.lightning.GuardedModule` in a user's Lightning script (tests/python/lightning_loop.py):
`lightning.Trainer` with DDP over Gloo on 2 ranks, an OOM on one rank recovered inside
`training_step`, the result equal to Lightning's own `accumulate_grad_batches` at the size the
guarded run settled at; metrics.jsonl in the Trainer's log_dir, and the guard's state in its
checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from conftest import max_diff, records, run_ranks

LOOP = Path(__file__).with_name("lightning_loop.py")


def sizes(out: str) -> list:
    return [int(m) for m in re.findall(r"^step \d+ loss \S+ micro_batch (\d+)$", out, re.M)]


def test_an_oom_in_training_step_on_one_rank_equals_lightnings_accumulation(tmp_path):
    root = tmp_path / "guarded"
    r = run_ranks(tmp_path, "guarded", "--root", str(root), script=LOOP, extra_env={"OOMGUARD_TEST_OOM_AT": "1:1:forward"})
    assert r.code == 0, r.out
    assert sizes(r.out) == [16, 8, 8, 8], r.out
    log_dir = root / "lightning_logs" / "version_0"
    ooms = [x for x in records(log_dir) if x["event"] == "oom"]
    assert [(o["step"], o["rank"], o["new_micro_batch_size"]) for o in ooms] == [(1, 1, 8)]
    # The Trainer's logger (here its CSVLogger) gets the guard's state at each step.
    import csv

    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    logged = [(float(x["oomguard/micro_batch_size"]), float(x["oomguard/oom_count"])) for x in rows
              if x.get("oomguard/micro_batch_size")]
    assert logged == [(16, 0), (8, 1), (8, 1), (8, 1)], rows
    ref = run_ranks(tmp_path, "plain", "--plain", "--micro-batch", "8", "--root", str(tmp_path / "plain"), script=LOOP)
    assert ref.code == 0, ref.out
    assert max_diff(ref.params, r.params) < 1e-12
    # Lightning's checkpoint carries the guard's state; resumed from it, the size is restored.
    ckpt = next((log_dir / "checkpoints").glob("*.ckpt"))
    state = torch.load(ckpt, weights_only=False)["oomguard"]
    assert state["step"] == 4, state
    again = run_ranks(
        tmp_path, "again", "--root", str(tmp_path / "again"), "--steps", "6", "--resume", str(ckpt), script=LOOP
    )
    assert again.code == 0, again.out
    assert "restored at step 4; micro_batch_size=8" in again.out and sizes(again.out) == [8, 8], again.out
