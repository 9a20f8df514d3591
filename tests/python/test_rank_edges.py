"""Ranks whose data differ (tests/python/rank_edges.py, two real Gloo ranks): loss units
counted apart under DDP and FSDP2, rows counted apart under FSDP2, DDP's per-forward buffer
sync; and the guard's scaler in `optimizer_step`, in one process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import oomguard
from conftest import run_ranks

EDGES = Path(__file__).with_name("rank_edges.py")
EXACT = 1e-12  # float64: the same sums in another order


def diffs(tmp: Path, case: str) -> dict:
    r = run_ranks(tmp, case, "--case", case, script=EDGES, out_flag=False, timeout=120)
    assert r.code == 0, r.out
    found: dict = {}
    for name, value in re.findall(r"^diff (\S+) (\S+)$", r.out, re.M):
        found.setdefault(name, []).append(float(value))
    return found


@pytest.mark.parametrize("wrap", ["ddp", "fsdp", "compiled-ddp"])
def test_units_counted_apart_give_the_mean_over_every_ranks_units(wrap, tmp_path):
    d = diffs(tmp_path, f"units-{wrap}")
    assert len(d[f"units-{wrap}"]) == 2, d
    assert max(d[f"units-{wrap}"]) < EXACT, d
    assert max(d[f"units-{wrap}-ranks"]) < EXACT, d


def test_fsdp2_units_with_the_sync_off_are_refused_on_every_rank(tmp_path):
    # The waiting gradients were weighed by units they could not be divided by: 7% off,
    # silently, before this refusal.
    r = run_ranks(tmp_path, "nosync", "--case", "units-fsdp-nosync", script=EDGES, out_flag=False, timeout=120)
    assert r.code == 0, r.out
    refused = re.findall(r"^refused (.*)$", r.out, re.M)
    assert len(refused) == 2 and all("set_requires_gradient_sync(False)" in line for line in refused), r.out


def test_fsdp2_ranks_with_other_row_counts_run_as_many_micro_batches(tmp_path):
    d = diffs(tmp_path, "rows")
    for key in ("rows", "rows-loss", "rows-eval"):
        assert len(d[key]) == 2 and max(d[key]) < EXACT, d


def test_ddp_ranks_with_other_row_counts_and_a_collective_in_loss_fn_run_as_many(tmp_path):
    # Rank 0 ran 3 micro-batches and rank 1 2: rank 1's last vote met rank 0's checkpoint
    # before its third all_reduce, and the collectives that followed did not match.
    r = run_ranks(tmp_path, "rows-ddp", "--case", "rows-ddp", script=EDGES, out_flag=False, timeout=120)
    assert r.code == 0, r.out
    d = {name: float(v) for name, v in re.findall(r"^diff (\S+) (\S+)$", r.out, re.M)}
    assert d.get("rows-ddp", 1.0) < EXACT, r.out
    # Three all_reduces a rank, each summing the two ranks' micro-batches: the 10 rows once.
    counts = re.findall(r"^counts (.*)$", r.out, re.M)
    assert len(counts) == 2 and counts[0] == counts[1] and sum(eval(counts[0])) == 10.0, r.out


def test_ddp_gradients_summed_in_place_are_freed_by_zero_grad_after_the_step(tmp_path):
    r = run_ranks(tmp_path, "freed", "--case", "freed", script=EDGES, out_flag=False, timeout=120)
    assert r.code == 0, r.out
    assert re.findall(r"^freed (\S+)$", r.out, re.M) == ["True", "True"], r.out


def test_a_guard_given_ddps_module_recovers_an_oom_through_the_wrapper(tmp_path):
    d = diffs(tmp_path, "raw-ddp")
    assert len(d["raw-ddp"]) == 2 and max(d["raw-ddp"]) < EXACT, d


def test_fsdp2_ranks_that_cannot_run_as_many_are_all_refused(tmp_path):
    r = run_ranks(tmp_path, "short", "--case", "rows-short", script=EDGES, out_flag=False, timeout=120)
    assert r.code == 0, r.out
    refused = re.findall(r"^refused (.*)$", r.out, re.M)
    assert len(refused) == 2, r.out
    assert all("a rank has only 2" in line and "runs 3" in line for line in refused), refused


def test_fsdp2_forwards_under_no_grad_leave_an_oom_and_units_exact(tmp_path):
    d = diffs(tmp_path, "nograd")
    assert len(d["nograd"]) == 4 and max(d["nograd"]) < EXACT, d


def test_ddp_syncing_buffers_at_each_forward_matches_plain_ddp(tmp_path):
    d = diffs(tmp_path, "buffers")
    assert len(d["buffers"]) == 2 and max(d["buffers"]) < EXACT, d


def test_a_ddp_communication_hook_is_named_and_the_average_is_exact(tmp_path):
    r = run_ranks(tmp_path, "comm-hook", "--case", "comm-hook", script=EDGES, out_flag=False, timeout=120)
    assert r.code == 0, r.out
    assert r.out.count("DDP's communication hook (fp16_compress_hook) is not run") == 1, r.out
    d = [float(v) for v in re.findall(r"^diff comm-hook (\S+)$", r.out, re.M)]
    assert len(d) == 2 and max(d) < EXACT, r.out


def test_bad_input_on_one_rank_at_the_first_step_stops_both_and_the_next_step_runs(tmp_path):
    r = run_ranks(tmp_path, "bad-first", "--case", "bad-first", script=EDGES, out_flag=False, timeout=120)
    assert r.code == 0, r.out
    assert sorted(re.findall(r"^stopped (\S+)$", r.out, re.M)) == ["PeerStopped", "ValueError"], r.out
    d = [float(v) for v in re.findall(r"^diff bad-first (\S+)$", r.out, re.M)]
    assert len(d) == 2 and max(d) == 0.0, r.out


def test_a_background_threads_collectives_pass_unvoted_through_an_oom(tmp_path):
    r = run_ranks(tmp_path, "background", "--case", "background", script=EDGES, out_flag=False, timeout=120,
                  extra_env={"OOMGUARD_TEST_OOM_AT": "1:1:backward"})
    assert r.code == 0, r.out
    found = re.findall(r"^diff background (\S+) ooms (\d+) overlapped (\w+)$", r.out, re.M)
    assert len(found) == 2, r.out
    assert all(float(d) < EXACT and ooms == "1" and over == "True" for d, ooms, over in found), found


def test_a_rank_alone_between_steps_is_waited_for_as_long_as_the_groups_timeout(tmp_path):
    """A vote waits what the process group's collectives wait (init_process_group's timeout),
    not a fixed time of the guard's: a rank 6 s alone between steps is waited for under a
    30 s timeout, and under a 2 s one the waiting rank stops, saying it timed out."""
    import time

    for timeout, ok in (("30", True), ("2", False)):
        t0 = time.perf_counter()
        r = run_ranks(tmp_path, f"slow-{timeout}", "--case", "slow-rank", script=EDGES, out_flag=False, timeout=120,
                      extra_env={"PG_TIMEOUT_S": timeout, "SLOW_S": "6"})
        took = time.perf_counter() - t0
        assert r.code == 0, r.out
        if ok:
            assert sorted(re.findall(r"^done (\d)$", r.out, re.M)) == ["0", "1"], r.out
        else:
            stops = re.findall(r"^stopped (.*)$", r.out, re.M)
            assert len(stops) == 2 and any("timed out" in s for s in stops), r.out
            assert took < 30, took


def test_optimizer_step_steps_with_the_guards_scaler():
    """Guard(scaler=s): `backward` scales by s, so `optimizer_step` must unscale by it too."""
    ends = []
    for passed in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        g = oomguard.Guard(model, global_batch_size=8, verbose=False, cache=False, snapshot=False, scaler=scaler)
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        g.backward((x, y), lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]))
        g.optimizer_step(opt, scaler=scaler if passed else None)
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    # Without it, a plain step on gradients 1024x too large.
    assert (ends[0] - ends[1]).abs().max().item() == 0.0
