"""The host-PyTorch half of scripts/gpu-check.sh (runs with the GPU host's own python3 and torch).

  gpu_check.py host                        -> JSON: torch, CUDA, GPU, driver
  gpu_check.py eager SHAPE_JSON            -> JSON: tokens/s and memory of the same GPT in eager PyTorch
  gpu_check.py check KIT OUT_DIR           -> runs every check, writes OUT_DIR/gpu-check.json

The GPT is oomguard's (src/model/gpt.rs), written the PyTorch way (nanoGPT): tied embedding and
head, pre-LayerNorm blocks, fused causal attention, GELU (tanh), AdamW (fused) on the same groups.
"""
import json
import math
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, n_head, bias):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(c, bias=bias), nn.LayerNorm(c, bias=bias)
        self.c_attn, self.c_proj = nn.Linear(c, 3 * c, bias=bias), nn.Linear(c, c, bias=bias)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c, bias=bias), nn.Linear(4 * c, c, bias=bias)
        self.n_head = n_head

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, s):
        super().__init__()
        c = s["n_embd"]
        self.wte, self.wpe = nn.Embedding(s["vocab_size"], c), nn.Embedding(s["block_size"], c)
        self.blocks = nn.ModuleList(Block(c, s["n_head"], s.get("bias", True)) for _ in range(s["n_layer"]))
        self.ln_f = nn.LayerNorm(c, bias=s.get("bias", True))

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def host():
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, total_memory=p.total_memory, capability=f"{p.major}.{p.minor}", bf16=torch.cuda.is_bf16_supported())
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError:
        info["driver"] = None
    print(json.dumps(info))


def eager(shape):
    s = json.loads(shape)
    torch.manual_seed(0)
    dev = "cuda"
    model = GPT(s).to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "wte.weight" and n != "wpe.weight"]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n != "wte.weight" and n != "wpe.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=6e-4, betas=(0.9, 0.95), fused=True)
    mb, accum, steps = s["micro_batch_size"], s.get("grad_accum_steps", 1), s.get("steps", 10)
    dtype = torch.bfloat16 if s.get("precision") == "bf16" else None
    x = torch.randint(0, min(256, s["vocab_size"]), (mb, s["block_size"]), device=dev)
    rates = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(accum):
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                loss = model(x, x) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        rates.append(mb * accum * s["block_size"] / (time.perf_counter() - t))
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({
        "tokens_per_s": sorted(rates[2:] or rates)[len(rates[2:] or rates) // 2], "params": n,
        "peak_bytes": torch.cuda.max_memory_allocated(), "live_bytes": torch.cuda.memory_allocated(),
        "reserved_bytes": torch.cuda.memory_reserved(), "loss": float(loss.detach()) * accum,
    }))


def flops_per_token(s, n_params):
    """nanoGPT's estimate (PaLM appendix B): 6N plus attention's 12 L T C."""
    return 6 * n_params + 12 * s["n_layer"] * s["block_size"] * s["n_embd"]


# Dense peak TFLOP/s by GPU name (bf16 tensor cores; fp32 without TF32), for MFU.
PEAK_TFLOPS = {"H100": (989.0, 67.0), "H200": (989.0, 67.0), "A100": (312.0, 19.5), "L4": (121.0, 30.3), "A10": (125.0, 31.2)}

TINY = """
model: {{n_layer: 2, n_head: 2, n_embd: 64, block_size: 64, vocab_size: 256}}
data: {{source: embedded, embedded_bytes: 262144}}
train: {{micro_batch_size: 16, grad_accum_steps: 1, max_steps: 3, eval_every: 0, device: cuda, seed: 7}}
log: {{every: 1}}
{extra}"""


def check(kit, out):
    import glob, os, pathlib, statistics, tempfile
    kit, out = pathlib.Path(kit), pathlib.Path(out)
    work = pathlib.Path(tempfile.mkdtemp())
    og = str(kit / "bin" / "oomguard")
    env = dict(os.environ, OOMGUARD_CACHE=str(work / "cache"))
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kit": (kit / "KIT.txt").read_text().strip() if (kit / "KIT.txt").exists() else None, "checks": {}}
    checks = report["checks"]

    def save():
        (out / "gpu-check.json").write_text(json.dumps(report, indent=1))

    def sh(cmd, timeout=1200):
        print("$", " ".join(map(str, cmd)), flush=True)
        r = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=env, timeout=timeout)
        print(r.stdout[-3000:], r.stderr[-3000:], sep="\n", flush=True)
        return r

    report["host"] = json.loads(subprocess.run([sys.executable, __file__, "host"], capture_output=True, text=True).stdout)
    cuda = report["host"]["cuda_available"]
    save()
    # 1-2. The CUDA-gated tests (cuda_guard: a real CUDA OOM under per_process_memory_fraction,
    # recovered, parameters equal to a clean run at the settled micro-batch within 4x the
    # difference between two clean runs; --memory-budget as a CUDA cap).
    for t in sorted(glob.glob(str(kit / "tests" / "*"))):
        r = sh([t, "--test-threads=1", "--nocapture"], timeout=1800)
        text = r.stdout + r.stderr
        checks["test " + os.path.basename(t)] = {"ok": r.returncode == 0, "ran_on_cuda": cuda and "CUDA not present" not in text,
                                                 "figures": [l for l in text.splitlines() if l.startswith("CUDA: ")], "tail": text.strip().splitlines()[-3:]}
        save()
    if not cuda:
        report["note"] = "CUDA is not available: the CUDA checks were skipped"
        save()
        return

    def train(name, extra="", args=()):
        d = work / name
        d.mkdir()
        (d / "c.yaml").write_text(TINY.format(extra=extra))
        r = sh([og, "train", d / "c.yaml", "--run-dir", d / "run", *args])
        log = (d / "run" / "train.log").read_text() if (d / "run" / "train.log").exists() else ""
        steps = [json.loads(l) for l in (d / "run" / "metrics.jsonl").read_text().splitlines() if '"event":"step"' in l] if (d / "run" / "metrics.jsonl").exists() else []
        return r, log + r.stderr, steps

    # 3. Allocator settings.
    r, log, _ = train("expandable", "memory: {allocator: {expandable_segments: true}}")
    checks["allocator expandable_segments"] = {"ok": r.returncode == 0 and "expandable_segments:True" in log}
    r, log, _ = train("async", "memory: {allocator: {backend: cudaMallocAsync}}")
    checks["allocator cudaMallocAsync re-executes"] = {"ok": r.returncode == 0 and "restarting so that libtorch loads" in log}
    r, log, _ = train("invalid", "memory: {allocator: {backend: bogus}}")
    checks["allocator invalid exits 2"] = {"ok": r.returncode == 2, "exit": r.returncode}
    save()

    # 4-5. Memory: oomguard's device stats and the planner against the host's PyTorch, by shape.
    shapes = [
        {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256, "vocab_size": 8192, "micro_batch_size": 16},
        {"n_layer": 8, "n_head": 8, "n_embd": 512, "block_size": 512, "vocab_size": 32768, "micro_batch_size": 8},
        {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50304, "micro_batch_size": 8},
    ]
    precisions = ["fp32"] + (["bf16"] if report["host"].get("bf16") else [])
    rows = []
    for i, shp in enumerate(shapes):
        for prec in precisions:
            model = {k: shp[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}
            extra = f"model: {json.dumps(model)}\ntrain: {{micro_batch_size: {shp['micro_batch_size']}, grad_accum_steps: 1, max_steps: 3, eval_every: 0, device: cuda, precision: {prec}}}\ndata: {{source: embedded, embedded_bytes: 4194304}}\n"
            name = f"shape{i}-{prec}"
            d = work / name
            d.mkdir()
            (d / "c.yaml").write_text(f"log: {{every: 1}}\n{extra}")
            r = sh([og, "train", d / "c.yaml", "--run-dir", d / "run"])
            steps = [json.loads(l) for l in (d / "run" / "metrics.jsonl").read_text().splitlines() if '"event":"step"' in l] if r.returncode == 0 else []
            plan = sh([og, "plan", d / "c.yaml", "--json", "--precision", prec, "--device-memory", str(report["host"]["total_memory"])])
            planned = json.loads(plan.stdout).get("configured_peak_bytes") if plan.returncode in (0, 3) and plan.stdout.strip() else None
            e = sh([sys.executable, __file__, "eager", json.dumps(dict(shp, precision=prec, steps=4))])
            eager_m = json.loads(e.stdout) if e.returncode == 0 else {}
            peak = max((s["memory"]["peak_bytes"] for s in steps), default=None)
            rows.append({
                "shape": model, "micro_batch_size": shp["micro_batch_size"], "precision": prec,
                "oomguard_peak_bytes": peak, "torch_peak_bytes": eager_m.get("peak_bytes"), "planned_peak_bytes": planned,
                "oomguard_reserved_bytes": steps[-1]["memory"].get("reserved_bytes") if steps else None, "torch_reserved_bytes": eager_m.get("reserved_bytes"),
                "peak_vs_torch": peak / eager_m["peak_bytes"] if peak and eager_m.get("peak_bytes") else None,
                "planned_vs_measured": planned / peak if planned and peak else None,
                "allocator_overhead_measured": eager_m["reserved_bytes"] / eager_m["peak_bytes"] - 1 if eager_m.get("peak_bytes") else None,
            })
            checks["memory and planner"] = {"ok": all(x["oomguard_peak_bytes"] for x in rows), "rows": rows}
            save()

    # 6. Throughput: GPT-2 124M's shape, oomguard and eager PyTorch alternated, as MFU.
    gpt2 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50304}
    tp = {}
    for prec in precisions:
        shp = dict(gpt2, micro_batch_size=8, grad_accum_steps=4, steps=12, precision=prec)
        d = work / f"tp-{prec}"
        d.mkdir()
        (d / "c.yaml").write_text(f"model: {json.dumps(gpt2)}\ndata: {{source: embedded, embedded_bytes: 8388608}}\ntrain: {{micro_batch_size: 8, grad_accum_steps: 4, max_steps: 12, eval_every: 0, device: cuda, precision: {prec}}}\nlog: {{every: 1}}\n")
        og_rates, eager_rates, n_params = [], [], None
        for rnd in range(2):
            run = d / f"run{rnd}"
            r = sh([og, "train", d / "c.yaml", "--run-dir", run])
            if r.returncode == 0:
                rates = [json.loads(l)["tokens_per_s"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"event":"step"' in l]
                og_rates.append(statistics.median(rates[2:]))
            e = sh([sys.executable, __file__, "eager", json.dumps(shp)])
            if e.returncode == 0:
                m = json.loads(e.stdout)
                eager_rates.append(m["tokens_per_s"])
                n_params = m["params"]
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in report["host"].get("gpu", "")), None)
        fpt = flops_per_token(gpt2, n_params) if n_params else None
        mfu = lambda r: r * fpt / (peak[0 if prec == "bf16" else 1] * 1e12) if (peak and fpt and r) else None
        og_tp, eager_tp = (statistics.median(og_rates) if og_rates else None), (statistics.median(eager_rates) if eager_rates else None)
        tp[prec] = {"oomguard_tokens_per_s": og_tp, "eager_tokens_per_s": eager_tp, "ratio": og_tp / eager_tp if og_tp and eager_tp else None,
                    "oomguard_mfu": mfu(og_tp), "eager_mfu": mfu(eager_tp), "rounds": {"oomguard": og_rates, "eager": eager_rates}}
        checks["throughput gpt2-124m"] = {"ok": bool(og_rates), "by_precision": tp}
        save()


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "host":
        host()
    elif cmd == "eager":
        eager(sys.argv[2])
    elif cmd == "check":
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {cmd}: host, eager SHAPE_JSON, check KIT OUT_DIR")
