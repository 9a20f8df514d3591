"""A training loop written the way nanoGPT's train.py is (https://github.com/karpathy/nanoGPT):
globals for the config, overridable as --key=value; DDP when RANK is set; gradient
accumulation with require_backward_grad_sync; autocast with GradScaler (float16); gradient
clipping; torch.compile. A tiny GPT and a synthetic token stream keep it on the CPU.
train_guarded.py is this file with oomguard put in (tests/python/test_nanogpt.py counts the
lines that differ)."""

import math
import os
from ast import literal_eval
import resource
import sys

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group

# -----------------------------------------------------------------------------
batch_size = 32  # micro-batch size
gradient_accumulation_steps = 4
block_size = 64
n_layer, n_head, n_embd, vocab_size = 2, 2, 64, 512
learning_rate = 1e-3
max_iters = 4
grad_clip = 1.0
dtype = "float16"
compile = True
cap_mb = 0.0  # RLIMIT_AS headroom from iteration 1 on (0: none)
cap_rank = 1
out = ""
for arg in sys.argv[1:]:  # nanoGPT's configurator, in short
    key, val = arg[2:].split("=")
    try:
        globals()[key] = literal_eval(val)
    except (SyntaxError, ValueError):
        globals()[key] = val
# -----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
else:
    ddp_rank, ddp_world_size, master_process = 0, 1, True
torch.manual_seed(1337)
torch.set_num_threads(1)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = torch.amp.autocast(device_type="cpu", dtype=ptdtype)


def get_batch(split, it):
    """This rank's rows of iteration `it`: every micro-step's, a fixed function of (it, rank)."""
    g = torch.Generator().manual_seed(1000 * it + ddp_rank)
    data = torch.randint(vocab_size, (batch_size * gradient_accumulation_steps, block_size + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1, betas=(0.9, 0.95))
scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
raw_model = model
if compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model)

for iter_num in range(max_iters):
    if cap_mb and ddp_rank == cap_rank and iter_num == 1:  # memory runs short from here on
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + int(cap_mb * 2**20), resource.RLIM_INFINITY))
    lr = learning_rate * 0.5 * (1 + math.cos(math.pi * iter_num / max_iters))
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    X_all, Y_all = get_batch("train", iter_num)
    for micro_step in range(gradient_accumulation_steps):
        X, Y = X_all[micro_step * batch_size : (micro_step + 1) * batch_size], Y_all[micro_step * batch_size : (micro_step + 1) * batch_size]
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}", flush=True)

resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
if master_process and out:
    torch.save([p.detach().clone() for p in raw_model.parameters()], out)
if ddp:
    destroy_process_group()
