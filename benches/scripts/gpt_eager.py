"""The eager half of benches/eager_gpt.rs: oomguard's built-in GPT written as plain PyTorch
(nanoGPT's shape: pre-LN blocks, causal scaled-dot-product attention, tanh-GELU MLP, a final
LayerNorm, the LM head tied to the token embedding, full logits and F.cross_entropy), trained
by the loop an eager user writes: AdamW (fused, betas 0.9/0.95, weight decay 0.1 on the 2-D
weights but the embeddings, oomguard's groups), clipping at 1.0, the loss read each step with
.item(). A step is timed from making its batch to the end of its update, as oomguard's step
records are. Usage: gpt_eager.py LAYERS HEADS EMBD BLOCK VOCAB BATCH STEPS THREADS. Prints the
median and the fastest tokens/s of steps 3.. as JSON."""
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

layers, heads, embd, block, vocab, batch, steps, threads = (int(a) for a in sys.argv[1:9])
torch.set_num_threads(threads)
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(embd), nn.LayerNorm(embd)
        self.c_attn, self.attn_proj = nn.Linear(embd, 3 * embd), nn.Linear(embd, embd)
        self.c_fc, self.mlp_proj = nn.Linear(embd, 4 * embd), nn.Linear(4 * embd, embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, 2)
        q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, embd), nn.Embedding(block, embd)
        self.h = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(embd)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.h:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))


model = Gpt()
decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith(("wte", "wpe"))]
rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.startswith(("wte", "wpe")))]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95), fused=True)
rates = []
for _ in range(steps):
    t = time.perf_counter()
    x = torch.randint(0, vocab, (batch, block))
    loss = model(x, x.roll(-1, 1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()
    rates.append(batch * block / (time.perf_counter() - t))
rates = sorted(rates[3:])
print(json.dumps({"tokens_per_s": rates[len(rates) // 2], "fastest_tokens_per_s": rates[-1]}))
