"""Trackers: rank 0's records in W&B (the real `wandb`, offline) and MLflow (the real `mlflow`,
a local file store), under Hugging Face Trainer's metric names, from two doors: a user's loop
under `oomguard launch` (OOMGUARD_TRACKERS) and `oomguard train` (`log.trackers`, whose
follower process mirrors metrics.jsonl). What each tracker holds is read back from its own
files and must equal metrics.jsonl, an OOM and a resume included. Nothing leaves the machine."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import LOOP, ROOT, env, launcher, records

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")
os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # this process reads the runs' file store back


def tracker_env(tmp: Path, **more: str) -> dict:
    return env(
        {
            "WANDB_MODE": "offline",
            "WANDB_PROJECT": "oomguard-test",
            "MLFLOW_TRACKING_URI": f"file:{tmp / 'mlruns'}",
            "MLFLOW_ALLOW_FILE_STORE": "true",
            "OOMGUARD_PYTHON": sys.executable,
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            **more,
        }
    )


def wandb_history(run_dir: Path) -> list:
    """Every history row W&B stored offline, read from its .wandb files (LevelDB-log framed
    protobuf Records, W&B's own format), oldest run first."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data, pos, chunk = Path(path).read_bytes(), 7, b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunk += data[pos + 7 : pos + 7 + n]
            pos += 7 + n
            if kind in (1, 4):  # a whole record, or a record's last piece
                r = pb.Record()
                r.ParseFromString(chunk)
                chunk = b""
                if r.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


def mlflow_metric(tmp: Path, run_id: str, name: str) -> dict:
    client = mlflow.MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}


def by_step(rows: list, key: str) -> dict:
    return {r["train/global_step"]: r[key] for r in rows if key in r}


def test_a_launched_loop_logs_its_records_to_wandb_and_mlflow(tmp_path):
    binary = launcher()
    if binary is None:
        pytest.skip("no oomguard binary (OOMGUARD_BIN, or target/release/oomguard: `cargo build --release`)")
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [str(binary), "launch", "--nproc-per-node", "2", "--standalone", "--run-dir", str(run_dir), str(LOOP), "--guard",
         "--steps", "3"],
        env=tracker_env(tmp_path, OOMGUARD_TRACKERS="wandb,mlflow", OOMGUARD_TEST_OOM_AT="1:1:backward"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stdout
    recs = records(run_dir)
    steps = {r["step"]: r for r in recs if r["event"] == "step"}
    assert len(steps) == 3 and any(r["event"] == "oom" for r in recs), recs
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert set(ids) == {"wandb", "mlflow", "logged_through"} and ids["logged_through"] == 2, ids
    # MLflow: HF Trainer's names there (loss, learning rate would be learning_rate), each step's value.
    assert mlflow_metric(tmp_path, ids["mlflow"], "loss") == pytest.approx({s: r["loss"] for s, r in steps.items()})
    mb = mlflow_metric(tmp_path, ids["mlflow"], "oomguard/micro_batch_size")
    assert mb[2] == steps[2]["micro_batch_size"] < steps[0]["micro_batch_size"], mb
    # W&B: train/loss against train/global_step, as HF's WandbCallback logs them.
    rows = wandb_history(run_dir)
    assert by_step(rows, "train/loss") == pytest.approx({s: r["loss"] for s, r in steps.items()})
    assert by_step(rows, "oomguard/oom") == {1: 1}
    # Only rank 0 logs: one W&B run.
    assert len(glob.glob(str(run_dir / "wandb" / "offline-run-*"))) == 1


def last_step(run_dir: Path) -> int:
    """The last step metrics.jsonl has so far (-1: none; a line being written is skipped)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return -1
    found = -1
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("event") == "step":
            found = max(found, r["step"])
    return found


def train_cmd(run_dir: Path, *args: str) -> list:
    return [str(launcher()), "train", str(ROOT / "configs" / "demo.yaml"), "--run-dir", str(run_dir),
            "--set", "train.eval_every=4", "--set", "train.eval_batches=1", "--set", "checkpoint.every_steps=4",
            "--set", "log.every=4", "--set", "optim.decay_steps=12", *args]


def train(tmp: Path, run_dir: Path, *args: str, **more: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(run_dir, *args), env=tracker_env(tmp, **more), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)


def test_oomguard_train_mirrors_metrics_jsonl_to_both_and_a_resume_goes_on_in_the_same_runs(tmp_path):
    if launcher() is None:
        pytest.skip("no oomguard binary (OOMGUARD_BIN, or target/release/oomguard: `cargo build --release`)")
    run_dir = tmp_path / "run"
    # The first start dies (kill -9: the host's OOM killer) past its step-4 checkpoint; its
    # follower sends what was written, then closes the runs.
    cmd = train_cmd(run_dir, "--set", "train.max_steps=12", "--set", "log.trackers=[wandb, mlflow]")
    p = subprocess.Popen(cmd, env=tracker_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
        if last_step(run_dir) >= 6:
            break
        time.sleep(0.05)
    children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()  # the follower
    p.kill()
    assert p.wait() == -9, "the first start ended before it was killed"

    def running(pid: str) -> bool:
        try:
            return "\tZ" not in Path(f"/proc/{pid}/status").read_text().split("State:")[1][:4]
        except (OSError, IndexError):
            return False

    while time.monotonic() < deadline and any(running(c) for c in children):
        time.sleep(0.2)
    assert children and not any(running(c) for c in children), "the follower did not finish"
    sent = run_dir / "trackers.json"
    first = json.loads(sent.read_text())
    assert first["logged_through"] >= 6, first
    p = train(tmp_path, run_dir, "--set", "train.max_steps=12", "--set", "log.trackers=[wandb, mlflow]", "--resume")
    assert p.returncode == 0, p.stdout
    recs = records(run_dir)
    steps = {r["step"]: r for r in recs if r["event"] == "step"}
    evals = {r["step"]: r["val_loss"] for r in recs if r["event"] == "eval"}
    assert sorted(steps) == list(range(12)) and len(evals) >= 2, recs
    assert any(r["event"] == "oom" for r in recs)  # the demo's pressure
    assert any(r["event"] == "resumed" and r["step"] <= first["logged_through"] for r in recs), "no step was redone"
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert (ids["wandb"], ids["mlflow"]) == (first["wandb"], first["mlflow"])
    # Each step once in MLflow, the redone ones too (the same values: not sent again).
    client = mlflow.MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    assert sorted(m.step for m in client.get_metric_history(ids["mlflow"], "loss")) == list(range(12))
    # One MLflow run across the resume, every step's loss and lr, the evaluations as eval_loss.
    assert mlflow_metric(tmp_path, ids["mlflow"], "loss") == pytest.approx({s: r["loss"] for s, r in steps.items()})
    assert mlflow_metric(tmp_path, ids["mlflow"], "learning_rate") == pytest.approx({s: r["lr"] for s, r in steps.items()})
    assert mlflow_metric(tmp_path, ids["mlflow"], "eval_loss") == pytest.approx(evals)
    # W&B: one run id, resumed; its rows over both segments hold every step once.
    assert len(glob.glob(str(run_dir / "wandb" / f"offline-run-*-{ids['wandb']}"))) == 2
    rows = wandb_history(run_dir)
    assert sorted(r["train/global_step"] for r in rows if "train/loss" in r) == list(range(12))
    assert by_step(rows, "train/loss") == pytest.approx({s: r["loss"] for s, r in steps.items()})
    assert by_step(rows, "eval/loss") == pytest.approx(evals)
    # A fork (--resume-from an older checkpoint) is another future: new runs, from its step.
    p = train(tmp_path, run_dir, "--set", "train.max_steps=10", "--set", "log.trackers=[mlflow]",
              "--resume-from", str(run_dir / "checkpoints" / "step-00000008"))
    assert p.returncode == 0, p.stdout
    forked = json.loads(sent.read_text())
    assert forked["mlflow"] != ids["mlflow"] and forked["logged_through"] == 9, forked
    assert sorted(m.step for m in client.get_metric_history(forked["mlflow"], "loss")) == [8, 9]


def test_a_tracker_that_cannot_start_is_a_clear_error_before_training(tmp_path):
    if launcher() is None:
        pytest.skip("no oomguard binary (OOMGUARD_BIN, or target/release/oomguard: `cargo build --release`)")
    # A tracker name oomguard does not know: the key, the known ones, exit 2.
    p = train(tmp_path, tmp_path / "a", "--set", "log.trackers=[wandbb]")
    assert p.returncode == 2 and "log.trackers" in p.stdout and "wandb, mlflow" in p.stdout, p.stdout
    # An interpreter without the tracker: it is named, with the install line; nothing trains.
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    p = train(tmp_path, tmp_path / "b", "--set", "log.trackers=[mlflow]", OOMGUARD_PYTHON=str(bare / "bin" / "python"))
    assert p.returncode == 2, p.stdout
    assert "names mlflow, which is not installed for" in p.stdout and "pip install mlflow" in p.stdout, p.stdout
    assert not any(r["event"] == "step" for r in records(tmp_path / "b"))
    # The second of two refuses its run after the first opened one: that refusal is said, and
    # no trackers.json names a run the start never used.
    p = train(tmp_path, tmp_path / "c", "--set", "log.trackers=[wandb, mlflow]", MLFLOW_TRACKING_URI="nosuchscheme://x")
    assert p.returncode == 2, p.stdout
    assert "names mlflow, which could not start a run" in p.stdout and "Traceback" not in p.stdout, p.stdout
    assert not (tmp_path / "c" / "trackers.json").exists()
    # The Python door: the variable is named.
    code = "import oomguard, torch; oomguard.Guard(torch.nn.Linear(2, 2), 4, run_dir='r')"
    p = subprocess.run([sys.executable, "-c", code], env=tracker_env(tmp_path, OOMGUARD_TRACKERS="tensorboard"),
                       cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert p.returncode != 0 and "OOMGUARD_TRACKERS: 'tensorboard' is not a tracker" in p.stdout, p.stdout
