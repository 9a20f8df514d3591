"""The experiment trackers a run's records are mirrored to (W&B, MLflow), under the metric
names Hugging Face's Trainer uses in each. One file serves both fronts: the Python guard
imports it, and `oomguard train` runs it beside itself as a follower of metrics.jsonl
(`python3 -c <this file> follow ...`), so it imports nothing from oomguard.

Invariant: a tracker receives only records already written to metrics.jsonl, and only when
the user named it (`trackers=`, OOMGUARD_TRACKERS, `log.trackers`): nothing is sent anywhere
otherwise. Where it goes is the tracker's own settings (WANDB_PROJECT, WANDB_MODE,
MLFLOW_TRACKING_URI, ...). A tracker that fails to log warns once and is dropped; training
goes on, and metrics.jsonl keeps everything.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Dict, Iterable, List, Optional, Tuple, Union

KNOWN = ("wandb", "mlflow")
ENV = "OOMGUARD_TRACKERS"
STATE = "trackers.json"  # RUN_DIR/trackers.json: each tracker's run id, so a resumed run goes on in it
THROUGH = "logged_through"  # ...and the last step they were sent, so a resume's redone steps are not sent twice
SAVE_EVERY_S = 5.0  # how often the last step sent is written while the run goes on

# metrics.jsonl's step fields -> HF Trainer's W&B names (its WandbCallback's rewrite_logs).
_STEP = (
    ("loss", "train/loss"),
    ("lr", "train/learning_rate"),
    ("grad_norm", "train/grad_norm"),
    ("tokens_per_s", "train/tokens_per_s"),
    ("micro_batch_size", "oomguard/micro_batch_size"),
    ("grad_accum_steps", "oomguard/grad_accum_steps"),
    ("step_time_s", "oomguard/step_time_s"),
)
_MEMORY = ("live_bytes", "peak_bytes", "host_rss_anon_bytes")


class TrackerError(Exception):
    """A tracker that is named but cannot start (not installed, or refused to open a run)."""


def names(value: Union[None, str, Iterable[str]], where: str) -> List[str]:
    """The trackers named by `value` ("wandb,mlflow" or a list); `where` names its source."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    chosen: List[str] = []
    for name in (str(i).strip().lower() for i in items):
        if not name:
            continue
        if name not in KNOWN:
            raise ValueError(f"{where}: {name!r} is not a tracker oomguard knows; the trackers are: wandb, mlflow")
        if name not in chosen:
            chosen.append(name)
    return chosen


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def scalars(record: dict) -> Optional[Tuple[int, Dict[str, float]]]:
    """A metrics.jsonl record as (step, {W&B name: value}), or None when it has none: HF
    Trainer's names (train/loss, train/learning_rate, train/grad_norm, eval/loss), the
    guard's own under oomguard/."""
    event, step = record.get("event"), record.get("step")
    if not isinstance(step, int):
        return None
    out: Dict[str, float] = {}
    if event == "step":
        out.update((dst, record[src]) for src, dst in _STEP if _number(record.get(src)))
        memory = record.get("memory") or {}
        out.update((f"oomguard/{k}", memory[k]) for k in _MEMORY if _number(memory.get(k)))
    elif event == "eval" and _number(record.get("val_loss")):
        out["eval/loss"] = record["val_loss"]
    elif event == "oom":
        out["oomguard/oom"] = 1
        if _number(record.get("new_micro_batch_size")) and record["new_micro_batch_size"] > 0:
            out["oomguard/micro_batch_size"] = record["new_micro_batch_size"]
    elif event in ("grow", "shrink") and _number(record.get("new_micro_batch_size")):
        out["oomguard/micro_batch_size"] = record["new_micro_batch_size"]
    return (step, out) if out else None


def mlflow_name(name: str) -> str:
    """HF Trainer's MLflow names: its logs' own keys (loss, learning_rate, eval_loss)."""
    if name.startswith("train/"):
        return name[len("train/") :]
    if name.startswith("eval/"):
        return "eval_" + name[len("eval/") :]
    return name


class _Wandb:
    def __init__(self, run_name: str, run_dir: str, run_id: Optional[str], config: Optional[dict]):
        import wandb

        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = wandb.init(
            name=run_name, dir=os.environ.get("WANDB_DIR") or run_dir, config=config, **resume
        )
        # As HF's Trainer does: every metric against the step, which a resumed run may repeat.
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)
        self.id = self.run.id

    def log(self, step: int, values: Dict[str, float]) -> None:
        self.run.log({**values, "train/global_step": step})

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_name: str, run_dir: str, run_id: Optional[str], config: Optional[dict]):
        import mlflow
        from mlflow.entities import Metric

        self._metric = Metric
        self.client = mlflow.MlflowClient()  # MLFLOW_TRACKING_URI's store, as mlflow itself picks
        if run_id is not None:
            try:
                self.client.get_run(run_id)
            except Exception:  # noqa: BLE001 - gone from the store: a new run
                run_id = None
        if run_id is None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "oomguard"
            found = self.client.get_experiment_by_name(experiment)
            eid = found.experiment_id if found else self.client.create_experiment(experiment)
            run_id = self.client.create_run(eid, run_name=run_name).info.run_id
            for key, value in _flat(config or {}).items():
                self.client.log_param(run_id, key, str(value)[:6000])
        self.id = run_id

    def log(self, step: int, values: Dict[str, float]) -> None:
        ms = int(time.time() * 1000)
        metrics = [self._metric(mlflow_name(k), float(v), ms, step) for k, v in values.items()]
        self.client.log_batch(self.id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.id)


_OPEN = {"wandb": _Wandb, "mlflow": _Mlflow}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _warn(line: str) -> None:
    print(f"oomguard WARNING: {line}", file=sys.stderr, flush=True)


def _write_state(path: str, state: dict) -> None:
    """trackers.json, whole or not at all (a temporary file renamed over it)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except OSError as e:
        _warn(f"cannot write {path}: {e}; a resumed run starts new tracker runs")


class Trackers:
    """The named trackers' runs for `run_dir` (rank 0's): opened at once, so that a tracker
    that is not installed or cannot start is an error before training, not a lost log.
    `mode`: "same" goes on in the runs trackers.json names (the Python guard's);
    "resume" also sends no step already sent (`oomguard train --resume` redoes the steps
    after its checkpoint: the trackers keep the values first sent for them); "new" opens
    new runs (a fresh start, or a fork)."""

    def __init__(
        self, chosen: List[str], run_dir: str, config: Optional[dict] = None, where: str = ENV, mode: str = "same"
    ):
        self.live: Dict[str, object] = {}
        self._state_path = state_path = os.path.join(run_dir, STATE)
        ids: dict = {}
        if mode != "new" and os.path.exists(state_path):
            try:
                with open(state_path) as f:
                    ids = json.load(f)
            except (OSError, ValueError) as e:
                _warn(f"cannot read {state_path} ({e}): new tracker runs are opened")
            ids = ids if isinstance(ids, dict) else {}
        through = ids.get(THROUGH)
        self.through = through if _number(through) else None  # the last step sent
        self._skip = self.through if mode == "resume" else None
        # The ids of the trackers named before, kept whether or not named now; written
        # only once every tracker named now has opened.
        self._ids = {k: v for k, v in ids.items() if k in KNOWN}
        self._opened, self._saved = False, time.monotonic()
        # The run directory's last two parts (runs/demo/001 -> demo/001): every config's
        # first run is 001.
        parts = os.path.abspath(run_dir).split(os.sep)
        run_name = "/".join(p for p in parts[-2:] if p)
        for name in chosen:
            try:
                self.live[name] = _OPEN[name](run_name, run_dir, ids.get(name), config)
            except ImportError:
                self.close()
                said = f"{where} names {name}, which is not installed for {sys.executable}: "
                said += f"`{sys.executable} -m pip install {name}`, or leave {name} out"
                raise TrackerError(said.lstrip()) from None
            except Exception as e:  # noqa: BLE001 - the tracker's own refusal, said as it said it
                self.close()
                raise TrackerError(f"{where} names {name}, which could not start a run: {e}".lstrip()) from e
        self._ids.update({n: t.id for n, t in self.live.items()})
        self._opened = True
        if self.live:
            _write_state(state_path, self._state())
        atexit.register(self.close)

    def _state(self) -> dict:
        state: dict = dict(self._ids)
        if self.through is not None:
            state[THROUGH] = self.through
        return state

    def log(self, record: dict) -> None:
        found = scalars(record) if self.live else None
        if found is None:
            return
        if self._skip is not None and found[0] <= self._skip:
            return  # sent before the resume: the trackers keep those values
        self.through = found[0] if self.through is None else max(self.through, found[0])
        for name, tracker in list(self.live.items()):
            try:
                tracker.log(*found)
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                _warn(f"{name} stopped logging: {e}; metrics.jsonl has every record")
                del self.live[name]
        # The step sent, every few seconds: a follower killed before it closes the runs
        # leaves at most that much for a resume to send again.
        if self.live and time.monotonic() - self._saved > SAVE_EVERY_S:
            self._saved = time.monotonic()
            _write_state(self._state_path, self._state())

    def close(self) -> None:
        had = bool(self.live)
        for name, tracker in list(self.live.items()):
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                _warn(f"{name} did not close cleanly: {e}")
        self.live.clear()
        if had and self._opened:
            _write_state(self._state_path, self._state())


def follow(run_dir: str, chosen: List[str], offset: int, config: Optional[dict], where: str, mode: str) -> int:
    """`oomguard train`'s follower: mirrors metrics.jsonl from `offset` until stdin closes (the
    run ended, however it ended), then what is left, then closes the trackers' runs. Prints
    `ready` once they are open; an error line and exit 2 when they cannot be."""
    import select
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the run's Ctrl-C is the run's: this drains, then ends
    try:
        trackers = Trackers(chosen, run_dir, config, where, mode)
    except TrackerError as e:
        print(e, file=sys.stderr, flush=True)
        return 2
    print("ready", flush=True)
    os.dup2(2, 1)  # the trackers' own chatter: nobody reads stdout any more
    path, pending, ended = os.path.join(run_dir, "metrics.jsonl"), "", False
    with open(path) as f:
        f.seek(offset)
        while True:
            if not ended:
                readable, _, _ = select.select([0], [], [], 0.5)
                ended = bool(readable) and os.read(0, 4096) == b""
            chunk = f.read()
            pending += chunk
            *lines, pending = pending.split("\n")
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    trackers.log(record)
            if ended and not chunk:
                break
    trackers.close()
    return 0


def _main(argv: List[str]) -> int:
    # follow RUN_DIR TRACKERS OFFSET CONFIG_JSON WHERE MODE (WHERE: the key the error lines name,
    # or ""; MODE: resume or new, as `Trackers` takes it)
    if len(argv) != 7 or argv[0] != "follow" or argv[6] not in ("resume", "new"):
        print("usage: follow RUN_DIR TRACKERS OFFSET CONFIG_JSON WHERE resume|new", file=sys.stderr)
        return 2
    _, run_dir, chosen, offset, config, where, mode = argv
    return follow(run_dir, names(chosen, where), int(offset), json.loads(config) or None, where, mode)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
