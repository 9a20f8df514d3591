"""`oomguard.hf.Trainer` against `transformers.Trainer`: what the guard costs a Trainer's step,
and what one recovery costs, in steps.

1. Overhead: GPT-2 from a small config (4 layers, 128 wide, 64 tokens, float32), 16 rows a
   step (8 x 2 accumulation), one process; the plain Trainer and the guarded one alternated
   in rounds of the same steps; per round, the median step time (on_step_end to on_step_end,
   after the first steps); the ratio of the medians over the rounds (goal: guarded/plain <=
   1.01, i.e. steps per second >= 0.99 of the plain Trainer's).
2. One recovery: the guarded Trainer with the test hook's OOM at step 4: in the first
   forward; in the last forward, the worst place the hook reaches (that micro-batch's forward
   is lost, then its rows run again at half the size); and after the last backward (the
   step's work is all kept: only the following steps shrink). A real OOM part-way through a
   backward keeps the parameters that backward completed. The step that ran out, minus the
   median step after it (at the size it settled at), over that median (goal <= 0.5).

Run by `make bench`: .venv/bin/python benches/python/hf_trainer.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["OOMGUARD_CACHE"] = tempfile.mkdtemp(prefix="oomguard-bench-cache-")
import torch  # noqa: E402
import transformers  # noqa: E402

import oomguard.hf  # noqa: E402

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
VOCAB, SEQ = 512, 64


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class Clock(transformers.TrainerCallback):
    def __init__(self):
        self.ends = []

    def on_step_begin(self, args, state, control, **kw):
        if not self.ends:
            self.ends.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        self.ends.append(time.perf_counter())

    def steps(self) -> list:
        return [b - a for a, b in zip(self.ends, self.ends[1:])]


def run(guarded: bool, steps: int, env: dict = None) -> list:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(cfg)
    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=steps,
            learning_rate=1e-3, logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, seed=0,
            disable_tqdm=True, dataloader_num_workers=0,
        )
        kind = oomguard.hf.Trainer if guarded else transformers.Trainer
        kw = {"oomguard": {"verbose": False}} if guarded else {}
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            kind(model=model, args=args, train_dataset=Rows(16 * steps), callbacks=[clock], **kw).train()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return clock.steps()


def overhead(rounds: int = 6, steps: int = 14, skip: int = 3) -> None:
    med = {False: [], True: []}
    for r in range(rounds):
        for guarded in (False, True) if r % 2 == 0 else (True, False):
            med[guarded].append(statistics.median(run(guarded, steps)[skip:]))
    plain, guarded = statistics.median(med[False]), statistics.median(med[True])
    print(f"overhead: {rounds} rounds x {steps - skip} steps each; median step plain {plain * 1e3:.2f} ms, "
          f"guarded {guarded * 1e3:.2f} ms")
    print(f"  per round, plain ms:   {[round(x * 1e3, 2) for x in med[False]]}")
    print(f"  per round, guarded ms: {[round(x * 1e3, 2) for x in med[True]]}")
    print(f"  guarded/plain = {guarded / plain:.4f} (goal <= 1.01); steps/s ratio = {plain / guarded:.4f} (goal >= 0.99)")


def recovery(site: str, steps: int = 12, at: int = 4) -> None:
    times = run(True, steps, {"OOMGUARD_TEST_OOM_AT": f"0:{at}:{site}"})
    after = statistics.median(times[at + 1:])
    cost = (times[at] - after) / after
    print(f"recovery ({site}, step {at}): the step {times[at] * 1e3:.2f} ms, a step after it {after * 1e3:.2f} ms: "
          f"{cost:.2f} steps (goal <= 0.5)")


if __name__ == "__main__":
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {os.cpu_count()} cpus, "
          f"load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')}")
    overhead()
    recovery("forward")
    recovery("forward:2")
    recovery("backward:2")
