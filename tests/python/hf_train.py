"""A user's Hugging Face Trainer script: a GPT-2 (or Llama) from a tiny config (no download),
float64, fixed-length token rows, `transformers.Trainer` or `oomguard.hf.Trainer` with the
same arguments. Writes the final parameters (--out) and the Trainer's log_history (--history).
Run as one process or as torchrun's ranks (RANK, WORLD_SIZE, MASTER_ADDR in the environment)."""

from __future__ import annotations

import argparse
import os
import sys
import json
import resource

import torch
import transformers

ap = argparse.ArgumentParser()
ap.add_argument("--guard", action="store_true", help="oomguard.hf.Trainer instead of transformers.Trainer")
ap.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
ap.add_argument("--per-device", type=int, default=8)
ap.add_argument("--accumulation", type=int, default=2)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--save-steps", type=int, default=0)
ap.add_argument("--resume", action="store_true")
ap.add_argument("--cap-mb", type=float, default=None, help="RLIMIT_AS this much above the VM size at train begin")
ap.add_argument("--cap-rank", type=int, default=None)
ap.add_argument("--output-dir", required=True)
ap.add_argument("--out", default=None)
ap.add_argument("--history", default=None)
ap.add_argument("--vocab", type=int, default=512)
ap.add_argument("--seq", type=int, default=32)
a = ap.parse_args()

torch.manual_seed(0)
if a.model == "gpt2":
    cfg = transformers.GPT2Config(
        vocab_size=a.vocab, n_positions=a.seq, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
else:
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=a.seq,
    )
    model = transformers.LlamaForCausalLM(cfg)
model = model.double()


class Tokens(torch.utils.data.Dataset):
    """Rows of tokens, a collator's dict per row (labels = input_ids, as a causal LM's)."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, a.vocab, (n, a.seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class Cap(transformers.TrainerCallback):
    """A real memory cap on one rank once training begins (the model and its set-up exist)."""

    def on_train_begin(self, args, state, control, **kw):
        import os

        rank = int(os.environ.get("RANK", "0"))
        if a.cap_mb is not None and (a.cap_rank is None or a.cap_rank == rank):
            with open("/proc/self/statm") as f:
                vm = int(f.read().split()[0]) * resource.getpagesize()
            limit = vm + int(a.cap_mb * (1 << 20))
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))

    def on_train_end(self, args, state, control, **kw):
        # The cap is the training's: the teardown after it (gloo's threads) runs without it.
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


args = transformers.TrainingArguments(
    output_dir=a.output_dir,
    per_device_train_batch_size=a.per_device,
    gradient_accumulation_steps=a.accumulation,
    max_steps=a.steps,
    learning_rate=1e-3,
    logging_steps=1,
    save_steps=a.save_steps or a.steps * 10,
    save_strategy="steps" if a.save_steps else "no",
    report_to=[],
    seed=0,
    use_cpu=True,
    dataloader_num_workers=0,
    disable_tqdm=True,
)
kind = transformers.Trainer
if a.guard:
    import oomguard.hf

    kind = oomguard.hf.Trainer
trainer = kind(model=model, args=args, train_dataset=Tokens(512), callbacks=[Cap()])
trainer.train(resume_from_checkpoint=True if a.resume else None)
if trainer.args.process_index == 0:
    if a.out:
        torch.save([p.detach().clone() for p in model.parameters()], a.out)
    if a.history:
        with open(a.history, "w") as f:
            json.dump(trainer.state.log_history, f)
if torch.distributed.is_initialized():
    # As a torchrun script ends: the group torn down before the interpreter (the Trainer
    # leaves it up; gloo's threads at interpreter exit can abort the process).
    torch.distributed.destroy_process_group()
# Then without the interpreter's teardown, where gloo's threads could still abort a rank
# (seen in the plain Accelerate loop, stop 57's CI); everything is written.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
