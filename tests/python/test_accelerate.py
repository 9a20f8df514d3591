"""`import oomguard` in a user's Accelerate loop (tests/python/accelerate_loop.py): the model,
optimizer and loader from `accelerator.prepare` (DDP over Gloo on 2 ranks), `guard.backward`
where `accelerator.backward` was. An OOM on one rank is recovered in-process, and the result
equals Accelerate's own gradient accumulation at the size the guarded run settled at."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import max_diff, records, run_ranks

LOOP = Path(__file__).with_name("accelerate_loop.py")


def test_an_oom_on_one_rank_in_an_accelerate_loop_equals_accelerates_accumulation(tmp_path):
    run_dir = tmp_path / "run"
    r = run_ranks(
        tmp_path, "guarded", "--run-dir", str(run_dir), script=LOOP,
        extra_env={"OOMGUARD_TEST_OOM_AT": "0:1:backward"},
    )
    assert r.code == 0, r.out
    assert re.findall(r"^step \d+ loss \S+ micro_batch (\d+)$", r.out, re.M) == ["8", "4", "4", "4"], r.out
    ooms = [x for x in records(run_dir) if x["event"] == "oom"]
    assert [(o["step"], o["rank"], o["new_micro_batch_size"]) for o in ooms] == [(1, 0, 4)]
    # Accelerate's own accumulation at the settled size: 4 rows a backward, 4 backwards a step.
    ref = run_ranks(tmp_path, "plain", "--plain", "--micro-batch", "4", script=LOOP)
    assert ref.code == 0, ref.out
    assert max_diff(ref.params, r.params) < 1e-10
