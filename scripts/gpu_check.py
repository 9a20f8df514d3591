"""The host-PyTorch half of scripts/gpu-check.sh (runs with the GPU host's own python3 and torch).

  gpu_check.py host                        -> JSON: torch, CUDA, GPU, driver, the MFU peak used
  gpu_check.py eager SHAPE_JSON            -> JSON: tokens/s and memory of the same GPT in eager PyTorch
  gpu_check.py peak NAME TOTAL_BYTES       -> JSON: the MFU peak the table gives that GPU (or null)
  gpu_check.py own-loop measure|run OUT ...  -> `import oomguard` in a plain loop on CUDA (a check's child)
  gpu_check.py own-fsdp2 OUT MB            -> the guard on FSDP2 over a 1-rank NCCL group (a child)
  gpu_check.py own-fp16 guard|plain OUT MB -> fp16 autocast and GradScaler, guarded or plain (a child)
  gpu_check.py check KIT OUT_DIR           -> runs every check, writes OUT_DIR/gpu-check.json

The GPT is oomguard's (src/model/gpt.rs), written the PyTorch way (nanoGPT): tied embedding and
head, pre-LayerNorm blocks, fused causal attention, GELU (tanh), AdamW (fused) on the same groups.
Both sides run under the same PYTORCH_ALLOC_CONF (the one oomguard logged) and are timed by one
rule (window_rate).
"""
import json
import os
import re
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
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# Dense peak TFLOP/s (no sparsity) from NVIDIA's datasheets, for MFU: bf16 on tensor cores, and
# fp32 without TF32 (PyTorch's default for matmuls, kept on both sides). Keyed by the words of
# the device's name and its memory, so that H100 SXM, PCIe and NVL, or a GH200 and an H200, are
# told apart; a GPU not listed gets no MFU rather than a neighbour's peak. (The A10G is left
# out: NVIDIA publishes no datasheet for it.)
PEAKS = [
    # label, words the name must hold, words it must not, memory GiB (as CUDA reports it), bf16, fp32
    ("H100 NVL", {"h100", "nvl"}, set(), (85, 100), 835.5, 60.0),
    ("H100 PCIe", {"h100", "pcie"}, set(), (75, 85), 756.5, 51.0),
    ("H100 SXM", {"h100"}, {"pcie", "nvl"}, (75, 85), 989.5, 67.0),
    ("H200 NVL", {"h200", "nvl"}, set(), (130, 145), 835.5, 60.0),
    ("H200 SXM", {"h200"}, {"nvl"}, (130, 145), 989.5, 67.0),
    ("GH200", {"gh200"}, set(), (90, 145), 989.5, 67.0),
    ("A100 80GB", {"a100"}, set(), (75, 85), 312.0, 19.5),
    ("A100 40GB", {"a100"}, set(), (35, 45), 312.0, 19.5),
    ("L40S", {"l40s"}, set(), (40, 50), 362.05, 91.6),
    ("L40", {"l40"}, set(), (40, 50), 181.05, 90.5),
    ("L4", {"l4"}, set(), (20, 25), 121.0, 30.3),
    ("A10", {"a10"}, set(), (20, 25), 125.0, 31.2),
    ("T4", {"t4"}, set(), (13, 16), None, 8.1),
    ("V100 SXM2", {"v100", "sxm2"}, set(), (14, 34), None, 15.7),
    ("V100 PCIe", {"v100", "pcie"}, set(), (14, 34), None, 14.0),
]


def peak_for(name, total_bytes):
    """The table's row for a GPU: {"label", "bf16", "fp32"} in dense TFLOP/s, or None."""
    words = set(re.split(r"[^a-z0-9]+", (name or "").lower()))
    gib = (total_bytes or 0) / 2**30
    for label, need, refuse, (lo, hi), bf16, fp32 in PEAKS:
        if need <= words and not refuse & words and lo <= gib <= hi:
            return {"label": label, "bf16": bf16, "fp32": fp32}
    return None


def window_rate(ends, tokens_per_step, warm=2):
    """The one timing rule for both sides: tokens/s over steps warm.., the wall clock from the end
    of step warm-1 to the end of the last step, each end taken after a device synchronise
    (oomguard's step records' elapsed_s; eager's loop below)."""
    n = len(ends) - warm
    return tokens_per_step * n / (ends[-1] - ends[warm - 1]) if n > 0 and warm >= 1 else None


def host():
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, total_memory=p.total_memory, capability=f"{p.major}.{p.minor}",
                    bf16=torch.cuda.is_bf16_supported(including_emulation=False), mfu_peak_tflops=peak_for(p.name, p.total_memory))
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
    mb, accum, steps, block = s["micro_batch_size"], s.get("grad_accum_steps", 1), s.get("steps", 10), s["block_size"]
    dtype = torch.bfloat16 if s.get("precision") == "bf16" else None
    ends = []
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        for _ in range(accum):
            # As oomguard does: each micro-batch's samples made on the host, then copied over.
            xy = torch.randint(0, min(256, s["vocab_size"]), (mb, block + 1)).to(dev)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                loss = model(xy[:, :-1], xy[:, 1:]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()  # oomguard ends each step the same way (src/train/run.rs)
        ends.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({
        "tokens_per_s": window_rate(ends, mb * accum * block), "step_ends_s": ends, "params": n,
        "peak_bytes": torch.cuda.max_memory_allocated(), "live_bytes": torch.cuda.memory_allocated(),
        "reserved_bytes": torch.cuda.memory_reserved(), "loss": float(loss.detach()) * accum,
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF"), "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
    }))


def flops_per_token(s, n_params):
    """nanoGPT's estimate (PaLM appendix B): 6N plus attention's 12 L T C."""
    return 6 * n_params + 12 * s["n_layer"] * s["block_size"] * s["n_embd"]


def step_records(run, event="step"):
    """The step (or `event`) records of a run directory's metrics.jsonl (a torn last line
    skipped)."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []:
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if v.get("event") == event:
            out.append(v)
    return out


def test_results(text):
    """{test name: "ok" | "FAILED"} from libtest's output (with --nocapture a result may not
    share its test's line, so the failures come from the closing list)."""
    names = re.findall(r"^test (\S+) \.\.\. ", text, re.M)
    tail = text.rsplit("\nfailures:\n", 1)[-1] if "\nfailures:\n" in text else ""
    failed = set(re.findall(r"^    (\S+)$", tail, re.M))
    return {n: "FAILED" if n in failed else "ok" for n in names}


TINY = """
model: {{n_layer: 2, n_head: 2, n_embd: 64, block_size: 64, vocab_size: 256}}
data: {{source: embedded, embedded_bytes: 262144}}
train: {{micro_batch_size: 16, grad_accum_steps: 1, max_steps: 3, eval_every: 0, device: cuda, seed: 7}}
log: {{every: 1}}
{extra}"""

# TINY wider and longer, at micro-batch 64: activations, not the fixed 64 MiB of cuBLAS
# workspaces (Hopper), make most of its peak, so that a limit at 60% of that peak fits a
# smaller micro-batch (as tests/cuda_guard.rs); where a budget must force a CUDA OOM.
WIDE = TINY.replace("n_embd: 64, block_size: 64", "n_embd: 128, block_size: 256").replace("micro_batch_size: 16", "micro_batch_size: 64")

# The memory rows run under both settings on both sides: oomguard's default, and PyTorch's.
ALLOC_SETTINGS = [("expandable_segments:True", "true"), ("expandable_segments:False", "false")]
ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def own_loop(mode, out, micro_batch=None, fraction=None):
    """`import oomguard` in a plain loop on CUDA (the check's child, run with the kit's wheel on
    PYTHONPATH). mode "measure": each size's peak for one step; mode "run": 4 steps of a plain
    AdamW loop under the guard (micro_batch: where it starts; fraction: the per-process memory
    fraction, so the caching allocator raises a real torch.OutOfMemoryError), with a run dir
    for metrics.jsonl and the OOM snapshots; writes the parameters and what happened to `out`."""
    import oomguard
    torch.manual_seed(0)
    dev = torch.device("cuda")
    # Activations dominate (16 positions a sample, a 4x wide hidden layer), so that a limit
    # between two sizes' peaks fails the larger one in its micro-batches, not in AdamW's step,
    # whose memory no size changes (the guard calls that infeasible, and rightly).
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    G = 1024
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(G, 16, 1024, generator=gen).to(dev), torch.randn(G, 16, 1024, generator=gen).to(dev)) for _ in range(4)]
    loss_fn = lambda b: F.mse_loss(model(b[0]), b[1])
    if mode == "measure":
        peaks = {}
        for mb in (G, G // 2, G // 4):
            g = oomguard.Guard(model, global_batch_size=G, micro_batch_size=mb, verbose=False, cache=False)
            g.backward(batches[0], loss_fn)
            opt.step()  # AdamW's state, as in the real run
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            g.backward(batches[0], loss_fn)
            opt.step()  # the step's peak: its micro-batches' and the update's
            peaks[mb] = torch.cuda.max_memory_allocated()
            opt.zero_grad(set_to_none=True)
        json.dump({"peaks": peaks, "total": torch.cuda.mem_get_info()[1]}, open(out, "w"))
        return
    if fraction:
        torch.cuda.set_per_process_memory_fraction(float(fraction))
    run_dir = out + ".run"
    guard = oomguard.Guard(model, global_batch_size=G, micro_batch_size=int(micro_batch), run_dir=run_dir, cache=False)
    sizes = []
    for b in batches:
        guard.backward(b, loss_fn)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sizes.append(guard.micro_batch_size)
    torch.save([p.detach().cpu() for p in model.parameters()], out)
    json.dump({"sizes": sizes, "ooms": guard.policy.num_ooms, "run_dir": run_dir}, open(out + ".json", "w"))


# The rows "own loop: FSDP2" and "own loop: fp16 GradScaler" (row, child kind): G rows a
# step, OWN_STEPS steps, an OOM from the guard's test hook at step 1.
OWN_ROWS = (("own loop: FSDP2", "fsdp2"), ("own loop: fp16 GradScaler", "fp16"))
OWN_G, OWN_STEPS = 64, 6


class Stack(nn.Module):
    """The own-loop rows' model: the GPT's blocks on float inputs (a batch is a dict of
    float tensors, and a row can overflow fp16 on purpose). No biases in the blocks: the
    key's gets a zero gradient but for rounding, which AdamW would blow up to full steps."""

    def __init__(self, c=128, n_layer=3, width=16):
        super().__init__()
        self.inp, self.out = nn.Linear(width, c), nn.Linear(c, width)
        self.blocks = nn.ModuleList(Block(c, 4, False) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(c, bias=False)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(self.ln_f(x))


def stack_batches(dev):
    gen = torch.Generator().manual_seed(1)
    make = lambda: torch.randn(OWN_G, 32, 16, generator=gen).to(dev)
    return [{"x": make(), "y": make()} for _ in range(OWN_STEPS)]


def fully_shard_fn():
    """FSDP2's fully_shard (torch >= 2.6's place, then the older one), or None."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            return None
    return fully_shard


def own_skip(kind, cuda):
    """Why this host cannot run the child `kind` (its row is recorded as skipped), or None."""
    if not cuda:
        return "CUDA is not available"
    if kind == "fp16":
        return None if hasattr(torch.amp, "GradScaler") else "this torch has no torch.amp.GradScaler"
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_nccl_available()):
        return "torch.distributed or NCCL is not available in this torch"
    return None if fully_shard_fn() else "this torch has no FSDP2 (fully_shard)"


def own_rows(cuda, run):
    """(name, row) for OWN_ROWS: skipped with the reason where this host cannot run one,
    else run(kind)'s row."""
    for name, kind in OWN_ROWS:
        why = own_skip(kind, cuda)
        yield name, {"ok": None, "skipped": why} if why else run(kind)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_steps(batches, step):
    """step(i, batch) for each batch, each timed to a device synchronise: the seconds."""
    ends = []
    for i, b in enumerate(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(i, b)
        torch.cuda.synchronize()
        ends.append(time.perf_counter() - t0)
    return ends


def own_result(out, run_dir, step_s, **extra):
    """A child's results, to OUT.json: from metrics.jsonl the sizes its steps ran at, its
    OOM records and the collectives its attempts ran (their checkpoints); the step times
    and `extra`."""
    import pathlib
    steps = step_records(pathlib.Path(run_dir))
    extra.update(sizes=[s.get("micro_batch_size") for s in steps], step_s=step_s,
                 oom_records=step_records(pathlib.Path(run_dir), "oom"),
                 collectives=sum(s.get("checkpoints", 0) for s in steps))
    json.dump(extra, open(out + ".json", "w"))


def own_fsdp2(out, micro_batch):
    """Row "own loop: FSDP2"'s child: a 1-rank NCCL group (the parent sets MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE, and the hook for the guarded run), Stack with fully_shard
    on each block and on the root, AdamW, guard.backward on a dict batch. Writes the full
    parameters to `out`, what happened to out.json."""
    import oomguard
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = Stack().cuda()
    shard = fully_shard_fn()
    for b in model.blocks:
        shard(b)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run_dir = out + ".run"
    guard = oomguard.Guard(model, global_batch_size=OWN_G, micro_batch_size=int(micro_batch),
                           run_dir=run_dir, snapshot=False, cache=False)
    loss_fn = lambda b: F.mse_loss(model(b["x"]), b["y"])

    def step(_, b):
        guard.backward(b, loss_fn)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_s = own_steps(stack_batches("cuda"), step)
    torch.save([p.full_tensor().detach().cpu() for p in model.parameters()], out)
    own_result(out, run_dir, step_s, backend=dist.get_backend())
    dist.destroy_process_group()


def own_fp16(mode, out, micro_batch):
    """Row "own loop: fp16 GradScaler"'s child: Stack under autocast fp16 with a GradScaler.
    mode "guard": guard.backward(batch, loss_fn, scaler=) and guard.optimizer_step(opt,
    scaler=) (the parent sets the hook); "plain": the usual loop at micro_batch
    (scaler.scale(loss * share).backward() per micro-batch, scaler.step, scaler.update).
    Step 2's batch holds a value beyond fp16's range, so both skip that update. SGD, not
    AdamW: Adam divides each gradient by its own size, which hides a wrong gradient and turns
    fp16 rounding of one near 0 into a full step. Writes as own_fsdp2 does, and the steps
    skipped."""
    import oomguard
    torch.manual_seed(0)
    model = Stack().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    mb = int(micro_batch)
    batches = stack_batches("cuda")
    batches[2]["x"][0, 0, 0] = 1e5  # fp16 tops out at 65504

    def loss_fn(b):
        with torch.autocast("cuda", dtype=torch.float16):
            return F.mse_loss(model(b["x"]), b["y"])

    run_dir = out + ".run"
    guard = oomguard.Guard(model, global_batch_size=OWN_G, micro_batch_size=mb, run_dir=run_dir,
                           snapshot=False, cache=False) if mode == "guard" else None
    # The guard's optimizer step: optimizer_step (named step before, where guard.step, the
    # steps done, hid it).
    name = "optimizer_step" if hasattr(guard, "optimizer_step") else "step"
    skipped = []

    def step(i, b):
        if guard is not None:
            guard.backward(b, loss_fn, scaler=scaler)
            applied = getattr(guard, name)(opt, scaler=scaler)
        else:
            for s in range(0, OWN_G, mb):
                part = {k: v[s:s + mb] for k, v in b.items()}
                scaler.scale(loss_fn(part) * (len(part["x"]) / OWN_G)).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            applied = scaler.get_scale() >= before
        opt.zero_grad(set_to_none=True)
        if not applied:
            skipped.append(i)

    step_s = own_steps(batches, step)
    torch.save([p.detach().cpu() for p in model.parameters()], out)
    own_result(out, run_dir, step_s, skipped=skipped, scale=scaler.get_scale(), optimizer_step=name)


def own_row(kind, work, sh, py_env):
    """Row "own loop: FSDP2" (kind fsdp2) or "own loop: fp16 GradScaler" (fp16), a check's
    part on CUDA with the kit's wheel (py_env: PYTHONPATH): the child guarded, an OOM from
    the guard's test hook at step 1, then the clean child at the size it settled at. FSDP2:
    an all-gather's OOM (in forward where FSDP2 runs none at world size 1: torch >= 2.9
    copies the shards); the reference the same loop with no hook (1e-5). fp16: an OOM in
    backward; the reference the usual GradScaler loop (the difference within 1e-3 of what
    training moved the parameters, the same steps skipped). step_time_ratio: guarded over
    clean, steps 1 on (step 0 warms up, and the guarded one runs at the larger size), the
    recovery included."""
    if py_env is None:
        return {"ok": False, "error": "the kit's wheel did not install (see the row above)"}
    fsdp = kind == "fsdp2"
    cmd, ref = (["own-fsdp2"], ["own-fsdp2"]) if fsdp else (["own-fp16", "guard"], ["own-fp16", "plain"])

    def child(args, hook):
        """(exit, what it wrote to OUT.json, else its error's last lines); args end OUT,
        MICRO_BATCH."""
        out = str(args[-2])
        extra = dict(py_env, OOMGUARD_TEST_OOM_AT=hook)
        if fsdp:  # a group of one rank, on a port of its own
            extra.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        try:
            r = sh([sys.executable, __file__, *args], timeout=600, extra_env=extra)
        except subprocess.TimeoutExpired:
            return "timeout", {"error": "timed out after 600 s"}
        if r.returncode == 0 and os.path.exists(out + ".json"):
            return 0, json.loads(open(out + ".json").read())
        return r.returncode, {"error": r.stderr.strip().splitlines()[-3:]}

    def guarded(hook):
        out = work / f"{kind}-{hook.split(':')[2]}.pt"
        return (out, *child([*cmd, out, OWN_G], hook))

    hook = "0:1:gather:2" if fsdp else "0:1:backward"
    out, code, res = guarded(hook)
    row = {}
    if fsdp and code == 0 and not res.get("oom_records") and not res.get("collectives"):
        # FSDP2 (torch >= 2.9) copies the shards at world size 1: no all-gather to fail.
        row["gather_hook"] = f"{hook} cannot fire: FSDP2 ran no collective at world size 1; 0:1:forward instead"
        hook = "0:1:forward"
        out, code, res = guarded(hook)
    sizes, ooms = res.get("sizes") or [], res.get("oom_records") or []
    row.update({"exit": code, "error": res.get("error"), "hook": hook, "sizes": sizes,
                "step_s": res.get("step_s"), "collectives": res.get("collectives"),
                "ooms": [{k: o.get(k) for k in ("step", "phase", "message")} for o in ooms]})
    clean = {}
    if code == 0 and sizes:
        c, clean = child([*ref, work / f"{kind}-clean.pt", sizes[-1]], "")
        row.update(clean_exit=c, clean_error=clean.get("error"), clean_step_s=clean.get("step_s"))
        if c == 0:
            a, b = torch.load(out), torch.load(work / f"{kind}-clean.pt")
            torch.manual_seed(0)  # the children's initial parameters
            norm = lambda ts: sum((t.double() ** 2).sum() for t in ts).sqrt().item()
            moved = norm(y - x.detach() for y, x in zip(b, Stack().parameters()))
            row["max_param_diff_vs_clean"] = max((x - y).abs().max().item() for x, y in zip(a, b))
            row["diff_vs_update"] = norm(x - y for x, y in zip(a, b)) / moved
            row["step_time_ratio"] = sum(res["step_s"][1:]) / sum(clean["step_s"][1:])
    halved_once = sizes == [OWN_G] + [OWN_G // 2] * (OWN_STEPS - 1) and [o.get("step") for o in ooms] == [1]
    if fsdp:
        row.update(backend=res.get("backend"), tolerance=1e-5, reference="the same guarded loop, no hook")
        close = res.get("backend") == "nccl" and row.get("max_param_diff_vs_clean", 1) <= 1e-5
    else:
        skipped = res.get("skipped")
        row.update(skipped_steps=skipped, clean_skipped_steps=clean.get("skipped"),
                   optimizer_step=res.get("optimizer_step"), scales=[res.get("scale"), clean.get("scale")],
                   tolerance=1e-3, reference="the usual GradScaler loop; diff_vs_update: "
                   "|guarded - clean| / |clean - initial| (L2)")
        close = row.get("diff_vs_update", 1) <= 1e-3 and bool(skipped) and skipped == clean.get("skipped")
    row["ok"] = code == 0 and halved_once and close
    return row


def read_safetensors(path):
    """A safetensors file's float32 tensors by name, read without the safetensors package."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__" or t["dtype"] != "F32":
            continue
        a, b = t["data_offsets"]
        out[name] = torch.frombuffer(bytearray(body[a:b]), dtype=torch.float32).reshape(t["shape"])
    return out


def python_model(kit, work, sh, cuda):
    """A Python model (model.kind: python) in bin/oomguard-torch-python, which embeds CPython,
    against this host's torch and Python: examples/python/tiny_lm.yaml (on CUDA wider and
    longer) trained clean (its peak), then under a budget of 3/4 of that peak (on CUDA 60%),
    so that its micro-batch of 16 runs out of
    memory inside the Python forward; the OOM is recovered with the same samples and the
    parameters equal those of a clean run configured at the size the guarded run settled at
    (the same reduction order: what the guard promises beyond float rounding)."""
    exe = kit / "bin" / "oomguard-torch-python"
    kit_txt = (kit / "KIT.txt").read_text() if (kit / "KIT.txt").exists() else ""
    m = re.search(r"Python models for Python (\d+\.\d+)", kit_txt)
    host_py = "%d.%d" % sys.version_info[:2]
    if not exe.exists():
        return {"ok": None, "skipped": "this kit has no bin/oomguard-torch-python"}
    if m and m.group(1) != host_py:
        return {"ok": None, "skipped": f"the kit embeds Python {m.group(1)}; this host's torch runs under Python {host_py}"}
    device = "cuda" if cuda else "cpu"
    res = {"device": device}
    config = kit / "examples" / "python" / "tiny_lm.yaml"
    share = 3 / 4
    if cuda:
        # Longer windows and a wider model on CUDA, so that activations, not the fixed 64 MiB
        # of cuBLAS workspaces (Hopper), make most of the peak; the limit then fits a smaller
        # micro-batch (as tests/cuda_guard.rs).
        text = config.read_text().replace("path: tiny_lm.py", f"path: {config.parent / 'tiny_lm.py'}")
        text = text.replace("settings: {dim: 128, layers: 2, block: 64}", "settings: {dim: 256, layers: 2, block: 256}")
        text = text.replace("block_size: 64 ", "block_size: 256 ")
        config, share = work / "tiny_lm_cuda.yaml", 0.6
        config.write_text(text)
    res["config_share_of_peak"] = share

    def run(name, budget, *sets):
        d = work / f"py-{name}"
        r = sh([exe, "train", config, "--run-dir", d, "--set", "train.max_steps=6",
                "--set", f"train.device={device}", "--set", f"memory.budget={budget}", *sets],
               extra_env={"OOMGUARD_CACHE": str(work / f"py-cache-{name}")})
        recs = [json.loads(l) for l in open(d / "metrics.jsonl")] if (d / "metrics.jsonl").exists() else []
        return r.returncode, recs, d

    code, recs, clean = run("clean", "none")
    peak = max((x["memory"]["peak_bytes"] for x in recs if x.get("event") == "step" and x.get("memory", {}).get("peak_bytes")), default=None)
    res.update({"clean_exit": code, "clean_peak_bytes": peak})
    if code == 0 and peak:
        code, recs, tight = run("tight", str(int(peak * share)))
        ooms = [x for x in recs if x.get("event") == "oom"]
        res.update({"tight_exit": code, "ooms": len(ooms), "oom_phases": [x.get("phase") for x in ooms],
                    "micro_batch_sizes": [x.get("micro_batch_size") for x in recs if x.get("event") == "step"]})
        settled = res["micro_batch_sizes"][-1] if res["micro_batch_sizes"] else None
        if code == 0 and settled:
            # tiny_lm.yaml's global batch is 32 (16 x 2).
            c2, _, same = run("settled", "none", "--set", f"train.micro_batch_size={settled}", "--set", f"train.grad_accum_steps={32 // settled}")
            if c2 == 0:
                a, b = read_safetensors(same / "model.safetensors"), read_safetensors(tight / "model.safetensors")
                res["max_param_diff_vs_clean"] = max((a[k] - b[k]).abs().max().item() for k in a)
    tol = 1e-4 if cuda else 1e-5
    res["tolerance"] = tol
    res["ok"] = res.get("tight_exit") == 0 and res.get("ooms", 0) >= 1 and "forward" in res.get("oom_phases", []) \
        and res.get("max_param_diff_vs_clean") is not None and res["max_param_diff_vs_clean"] <= tol
    return res


# check's parts, in the order they run (GPU_CHECK_PARTS).
PARTS = ("tests", "python", "allocator", "nccl", "overlap", "snapshot", "own", "memory", "syncs", "throughput", "fit")


def check(kit, out):
    import glob, pathlib, statistics, tempfile
    kit, out = pathlib.Path(kit), pathlib.Path(out)
    work = pathlib.Path(tempfile.mkdtemp())
    og = str(kit / "bin" / "oomguard")
    # Allocator settings come from each run's config (or are given to eager), never the host's.
    inherited = {v: os.environ[v] for v in ALLOC_VARS if v in os.environ}
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_VARS}
    env["OOMGUARD_CACHE"] = str(work / "cache")
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kit": (kit / "KIT.txt").read_text().strip() if (kit / "KIT.txt").exists() else None,
              "command": "gpu-kit/scripts/gpu-check.sh", "inherited_alloc_conf_removed": inherited, "checks": {}}
    checks = report["checks"]
    # GPU_CHECK_PARTS (a comma list of PARTS) runs some parts only, e.g. in parallel runs of
    # their own; every part runs by default.
    parts = [p for p in os.environ.get("GPU_CHECK_PARTS", "").split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        sys.exit(f"GPU_CHECK_PARTS: unknown part(s) {', '.join(unknown)}: the parts are {', '.join(PARTS)}")
    report["parts"] = parts or list(PARTS)
    want = lambda part: part in report["parts"]

    def save():
        (out / "gpu-check.json").write_text(json.dumps(report, indent=1))

    def sh(cmd, timeout=1200, extra_env=None):
        print("$", " ".join(map(str, cmd)), flush=True)
        r = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=dict(env, **(extra_env or {})), timeout=timeout)
        print(r.stdout[-3000:], r.stderr[-3000:], sep="\n", flush=True)
        return r

    report["host"] = json.loads(subprocess.run([sys.executable, __file__, "host"], capture_output=True, text=True).stdout)
    cuda = report["host"]["cuda_available"]
    save()
    # 1-2. The test binaries: tests/cuda_guard.rs (a real CUDA OOM under per_process_memory_fraction,
    # recovered, parameters equal to a clean run at the settled micro-batch within 4x the
    # difference between two clean runs; --memory-budget as a CUDA cap) and tests/guard.rs, which
    # is CPU-only and checks the kit's binaries against this host's torch. Where each test ran is
    # read from its runs' step records (tests/common: OOMGUARD_TEST_DEVICES).
    if want("tests"):
        for t in sorted(glob.glob(str(kit / "tests" / "*"))):
            name = os.path.basename(t)
            devfile = work / f"devices-{name}.jsonl"
            r = sh([t, "--test-threads=1", "--nocapture"], timeout=1800, extra_env={"OOMGUARD_TEST_DEVICES": str(devfile)})
            text = r.stdout + r.stderr
            by_test = {}
            for line in (devfile.read_text().splitlines() if devfile.exists() else []):
                run = json.loads(line)
                by_test.setdefault(run["test"], set()).update(run["devices"])
            devices = sorted(set().union(*by_test.values()))
            on_cuda = sorted(k for k, v in by_test.items() if any(d.startswith("cuda") for d in v))
            results = test_results(text)
            # On a GPU every CUDA test must have trained on it: one that returned early is no pass.
            all_on_cuda = not (cuda and name == "cuda_guard") or set(results) <= set(on_cuda)
            checks["test " + name] = {"ok": r.returncode == 0 and all_on_cuda, "exit": r.returncode, "ran_on_cuda": bool(on_cuda), "devices": devices,
                                      "tests_on_cuda": on_cuda, "devices_by_test": {k: sorted(v) for k, v in by_test.items()}, "results": results,
                                      "figures": [l for l in text.splitlines() if l.startswith("CUDA: ")], "tail": text.strip().splitlines()[-3:]}
            save()
    # 2b. A Python model in-process (bin/oomguard-torch-python), on CUDA where there is one, else
    # on the CPU: an OOM inside its Python forward recovered, its parameters the clean run's.
    if want("python"):
        checks["python model: an OOM inside a Python forward recovered"] = python_model(kit, work, sh, cuda)
        save()
    if not cuda:
        if want("own"):
            checks.update(own_rows(cuda, None))
        report["note"] = "CUDA is not available: the CUDA checks were skipped"
        save()
        return

    def logged_alloc_conf(log):
        m = re.findall(r"allocator settings: (\S+)", log)
        return m[-1] if m else None

    def train(name, extra="", args=(), base=TINY):
        d = work / name
        d.mkdir()
        (d / "c.yaml").write_text(base.format(extra=extra))
        r = sh([og, "train", d / "c.yaml", "--run-dir", d / "run", *args])
        log = (d / "run" / "train.log").read_text() if (d / "run" / "train.log").exists() else ""
        return r, log + r.stderr, step_records(d / "run")

    wide = {}

    def wide_peak():
        """WIDE's peak at micro-batch 64, free (measured once)."""
        if "peak" not in wide:
            _, _, steps = train("wide-free", "", ["--memory-budget", "none"], base=WIDE)
            wide["peak"] = steps[0]["memory"]["peak_bytes"] if steps else None
        return wide["peak"]

    # 3. Allocator settings.
    if want("allocator"):
        r, log, _ = train("expandable", "memory: {allocator: {expandable_segments: true}}")
        checks["allocator expandable_segments"] = {"ok": r.returncode == 0 and "expandable_segments:True" in log}
        r, log, _ = train("async", "memory: {allocator: {backend: cudaMallocAsync}}")
        checks["allocator cudaMallocAsync re-executes"] = {"ok": r.returncode == 0 and "restarting so that libtorch loads" in log}
        r, log, _ = train("invalid", "memory: {allocator: {backend: bogus}}")
        checks["allocator invalid exits 2"] = {"ok": r.returncode == 2, "exit": r.returncode}
        save()

    # 3b. Data parallel on NCCL, as a group of one rank (the lent machines have one GPU, and
    # NCCL refuses two ranks on one device): under the launcher the group forms over NCCL on
    # this rank's GPU, every collective of a step runs (agreements, the gradients' all-reduce,
    # the start's agreement), and a CUDA OOM under a budget at 60% of WIDE's peak is
    # recovered through the agreement.
    if want("nccl"):
        peak = wide_peak()
        nccl = {"peak": peak}
        if peak:
            budget = peak * 6 // 10
            d = work / "nccl"
            d.mkdir()
            (d / "c.yaml").write_text(WIDE.format(extra="memory: {cooldown_steps: 1000}"))
            r = sh([og, "launch", "--standalone", "--nproc-per-node", "1", "--no-python", og, "train", d / "c.yaml", "--run-dir", d / "run",
                    "--memory-budget", str(budget)], extra_env={"OOMGUARD_GROUP_OF_ONE": "1"})
            log = r.stdout + r.stderr
            steps = step_records(d / "run")
            ooms = [json.loads(l) for l in (d / "run" / "metrics.jsonl").read_text().splitlines() if '"event":"oom"' in l] if (d / "run" / "metrics.jsonl").exists() else []
            nccl.update({"exit": r.returncode, "budget": budget, "joined_nccl": "(nccl) joined the group" in log, "ooms": len(ooms),
                         "micro_batches": [s.get("micro_batch_size") for s in steps], "world_sizes": sorted({s.get("world_size") for s in steps}),
                         "comm_s": [s.get("comm_s") for s in steps]})
            nccl["ok"] = r.returncode == 0 and nccl["joined_nccl"] and len(ooms) > 0 and len(steps) == 3 and all(m and m < 64 for m in nccl["micro_batches"])
        else:
            nccl["ok"] = False
        checks["nccl group of one rank"] = nccl
        save()

    # 3d. The overlapped reduction's hook path on NCCL at world size 1 (issue 56): the same
    # group of one rank, its gradients reduced from backward's hooks (on by default on CUDA)
    # and after backward, 30 steps each, alternated twice: the ratio of median step times is
    # the hooks' and buckets' overhead (at world size 1 there is nothing to hide), and
    # `comm_s` the exposed reduction and agreements.
    if want("overlap"):
        ov = {}
        for rnd in range(2):
            for mode in ("true", "false"):
                d = work / f"overlap-{mode}-{rnd}"
                d.mkdir()
                (d / "c.yaml").write_text(TINY.format(extra=""))
                r = sh([og, "launch", "--standalone", "--nproc-per-node", "1", "--no-python", og, "train", d / "c.yaml", "--run-dir", d / "run",
                        "--memory-budget", "none", "--max-steps", "30", "--set", f"train.overlap_grad_reduce={mode}"],
                       extra_env={"OOMGUARD_GROUP_OF_ONE": "1"})
                steps = step_records(d / "run")
                row = ov.setdefault(mode, {"exits": [], "step_s": [], "comm_s": [], "steps": []})
                row["exits"].append(r.returncode)
                row["steps"].append(len(steps))
                row["step_s"] += [s.get("step_time_s") for s in steps[5:] if s.get("step_time_s") is not None]
                row["comm_s"] += [s.get("comm_s") for s in steps[5:] if s.get("comm_s") is not None]
        for row in ov.values():
            row["median_step_s"] = statistics.median(row["step_s"]) if row["step_s"] else None
            row["median_comm_s"] = statistics.median(row["comm_s"]) if row["comm_s"] else None
            del row["step_s"], row["comm_s"]
        a, b = ov.get("true", {}).get("median_step_s"), ov.get("false", {}).get("median_step_s")
        ov["overlapped_over_after_backward"] = a / b if a and b else None
        ov["ok"] = all(e == 0 for m in ("true", "false") for e in ov[m]["exits"]) and all(n == 30 for m in ("true", "false") for n in ov[m]["steps"])
        checks["overlapped reduction on nccl, world size 1"] = ov
        save()

    # 3c. The memory snapshot of a real CUDA OOM (issue 24): libtorch's recorder and OOM
    # observer write oom/001/snapshot.pickle, which this host's torch.cuda._memory_viz reads,
    # and summary.json, whose reserved bytes agree with the snapshot's segments.
    if want("snapshot"):
        peak = wide_peak()
        r, log, _ = train("snapshot", "", ["--memory-budget", str(peak * 6 // 10 if peak else 1 << 20)], base=WIDE)
        snap = work / "snapshot" / "run" / "oom" / "001"
        viz = {}
        for cmd in ("stats", "trace"):
            v = sh([sys.executable, "-m", "torch.cuda._memory_viz", cmd, snap / "snapshot.pickle"]) if snap.exists() else None
            viz[cmd] = v is not None and v.returncode == 0
        summary = json.loads((snap / "summary.json").read_text()) if (snap / "summary.json").exists() else {}
        seg_total = None
        if snap.exists():
            import pickle
            with open(snap / "snapshot.pickle", "rb") as f:
                seg_total = sum(x["total_size"] for x in pickle.load(f)["segments"])
        checks["memory snapshot on a CUDA OOM"] = {
            "ok": r.returncode in (0, 3) and all(viz.values()) and summary.get("reserved_bytes") == seg_total and seg_total is not None
            and sum(summary.get("categories", {}).values()) == seg_total,
            "exit": r.returncode, "memory_viz": viz, "summary_reserved": summary.get("reserved_bytes"), "segments_total": seg_total,
            "text": summary.get("text")}
        save()

    # 3d. `import oomguard` (the kit's abi3 wheel, python/) in a plain PyTorch loop: a real CUDA
    # OOM (the caching allocator under a per-process memory fraction between the peaks of
    # micro-batch 1024 and 512) recovered in-process, PyTorch's memory snapshot written under
    # the run dir (read by this host's memory_viz), and the parameters equal to a clean run
    # that starts at the size the guarded run settled at.
    if want("own"):
        own = {}
        wheels = sorted(glob.glob(str(kit / "python" / "oomguard-*.whl")))
        pylib = work / "pylib"
        pip = sh([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", pylib, *wheels[-1:]]) if wheels else None
        own["wheel"] = wheels[-1] if wheels else None
        py_env = None
        if pip is not None and pip.returncode == 0:
            py_env = {"PYTHONPATH": f"{pylib}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            m = sh([sys.executable, __file__, "own-loop", "measure", work / "own-measure.json"], extra_env=py_env)
            measured = json.loads((work / "own-measure.json").read_text()) if m.returncode == 0 else {}
            peaks = {int(k): v for k, v in measured.get("peaks", {}).items()}
            own["peaks"] = peaks
            if peaks:
                fraction = (peaks[1024] + peaks[512]) / 2 / measured["total"]
                g = sh([sys.executable, __file__, "own-loop", "run", work / "own-guarded.pt", "1024", f"{fraction:.6f}"], extra_env=py_env)
                res = json.loads((work / "own-guarded.pt.json").read_text()) if g.returncode == 0 else {}
                own.update({"exit": g.returncode, "fraction": fraction, "sizes": res.get("sizes"), "ooms": res.get("ooms")})
                if res.get("sizes"):
                    settled = res["sizes"][0]
                    c = sh([sys.executable, __file__, "own-loop", "run", work / "own-clean.pt", str(settled), ""], extra_env=py_env)
                    if c.returncode == 0:
                        a, b = torch.load(work / "own-guarded.pt"), torch.load(work / "own-clean.pt")
                        own["max_param_diff_vs_clean_at_settled"] = max((x - y).abs().max().item() for x, y in zip(a, b))
                    snaps = sorted(glob.glob(os.path.join(res["run_dir"], "oom", "*", "snapshot.pickle")))
                    own["snapshots"] = snaps
                    own["memory_viz_stats"] = bool(snaps) and sh([sys.executable, "-m", "torch.cuda._memory_viz", "stats", snaps[0]]).returncode == 0
                    recs = [json.loads(l) for l in open(os.path.join(res["run_dir"], "metrics.jsonl"))]
                    own["oom_records"] = [r for r in recs if r.get("event") == "oom"]
        own["ok"] = bool(own.get("ooms")) and (own.get("sizes") or [1024])[-1] < 1024 and own.get("memory_viz_stats") is True \
            and own.get("max_param_diff_vs_clean_at_settled") is not None and own["max_param_diff_vs_clean_at_settled"] < 1e-5
        checks["python guard: a real CUDA OOM in a plain loop"] = own
        save()

        # 3e. `import oomguard` in two more loops of one's own, each with an OOM from the guard's
        # test hook (own_row): FSDP2 over a 1-rank NCCL group, and fp16 with a GradScaler.
        for name, row in own_rows(cuda, lambda kind: own_row(kind, work, sh, py_env)):
            checks[name] = row
            save()

    def og_run(d, yaml):
        """oomguard trains `yaml` in d/run: (exit, step records, the allocator settings it logged)."""
        d.mkdir()
        (d / "c.yaml").write_text(yaml)
        r = sh([og, "train", d / "c.yaml", "--run-dir", d / "run"])
        log = (d / "run" / "train.log").read_text() if (d / "run" / "train.log").exists() else ""
        return r.returncode, step_records(d / "run") if r.returncode == 0 else [], logged_alloc_conf(log + r.stderr)

    def eager_run(shape, alloc_conf):
        e = sh([sys.executable, __file__, "eager", json.dumps(shape)], extra_env={"PYTORCH_ALLOC_CONF": alloc_conf} if alloc_conf else None)
        return json.loads(e.stdout) if e.returncode == 0 else {}

    ratio = lambda a, b: a / b if a and b else None

    precisions = ["fp32"] + (["bf16"] if report["host"].get("bf16") else [])
    # 4-5. Memory: oomguard's device stats and the planner's estimate against the host's PyTorch,
    # by shape, precision and allocator setting (the same PYTORCH_ALLOC_CONF on both sides).
    if want("memory"):
        shapes = [
            {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256, "vocab_size": 8192, "micro_batch_size": 16},
            {"n_layer": 8, "n_head": 8, "n_embd": 512, "block_size": 512, "vocab_size": 32768, "micro_batch_size": 8},
            {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50304, "micro_batch_size": 8},
        ]
        rows = []
        for i, shp in enumerate(shapes):
            for prec in precisions:
                for alloc, expandable in ALLOC_SETTINGS:
                    model = {k: shp[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}
                    d = work / f"shape{i}-{prec}-{expandable}"
                    yaml = (f"log: {{every: 1}}\nmodel: {json.dumps(model)}\n"
                            f"train: {{micro_batch_size: {shp['micro_batch_size']}, grad_accum_steps: 1, max_steps: 3, eval_every: 0, device: cuda, precision: {prec}}}\n"
                            f"data: {{source: embedded, embedded_bytes: 4194304}}\nmemory: {{allocator: {{expandable_segments: {expandable}}}}}\n")
                    code, steps, og_alloc = og_run(d, yaml)
                    plan = sh([og, "plan", d / "c.yaml", "--json", "--precision", prec, "--device-memory", str(report["host"]["total_memory"])])
                    estimate = json.loads(plan.stdout) if plan.returncode in (0, 3) and plan.stdout.strip() else {}
                    planned = estimate.get("configured_peak_bytes")
                    planned_overhead = estimate.get("estimate", {}).get("allocator_overhead")
                    eager_m = eager_run(dict(shp, precision=prec, steps=4), og_alloc)
                    peak = max((s["memory"]["peak_bytes"] for s in steps), default=None)
                    reserved = steps[-1]["memory"].get("reserved_bytes") if steps else None
                    rows.append({
                        "shape": model, "micro_batch_size": shp["micro_batch_size"], "precision": prec, "alloc_conf": alloc,
                        "oomguard_alloc_conf": og_alloc, "torch_alloc_conf": eager_m.get("alloc_conf"),
                        "oomguard_devices": sorted({s.get("device") for s in steps}),
                        "oomguard_peak_bytes": peak, "torch_peak_bytes": eager_m.get("peak_bytes"), "planned_peak_bytes": planned,
                        # Reserved: the caching allocator's bytes after the last step, on both sides.
                        "oomguard_reserved_bytes": reserved, "torch_reserved_bytes": eager_m.get("reserved_bytes"),
                        "peak_vs_torch": ratio(peak, eager_m.get("peak_bytes")), "reserved_vs_torch": ratio(reserved, eager_m.get("reserved_bytes")),
                        # The planner's estimate includes its allocator overhead: it is a reserved-bytes figure.
                        "planned_vs_measured": ratio(planned, peak), "planned_vs_reserved": ratio(planned, reserved),
                        "allocator_overhead_measured": reserved / peak - 1 if reserved and peak else None,
                        "allocator_overhead_planned": planned_overhead,
                        "torch_allocator_overhead_measured": eager_m["reserved_bytes"] / eager_m["peak_bytes"] - 1 if eager_m.get("peak_bytes") else None,
                    })
                    checks["memory and planner"] = {"ok": all(x["oomguard_peak_bytes"] and x["oomguard_alloc_conf"] == x["torch_alloc_conf"] for x in rows), "rows": rows}
                    save()
        span = lambda vals: [min(vals), max(vals)] if vals else None
        summary = {}
        for alloc, _ in ALLOC_SETTINGS:
            rs = [x for x in rows if x["alloc_conf"] == alloc]
            pick = lambda key, prec=None: [x[key] for x in rs if x[key] is not None and (prec is None or x["precision"] == prec)]
            summary[alloc] = {
                "rows": len(rs), "peak_vs_torch": span(pick("peak_vs_torch")), "reserved_vs_torch": span(pick("reserved_vs_torch")),
                "rows_reserving_less_than_torch": sum(1 for v in pick("reserved_vs_torch") if v < 1),
                "planned_vs_reserved": span(pick("planned_vs_reserved")), "rows_planned_covers_reserved": sum(1 for v in pick("planned_vs_reserved") if v >= 1),
                "allocator_overhead_measured": {p: span(pick("allocator_overhead_measured", p)) for p in precisions},
            }
        checks["memory and planner"]["summary"] = summary
        save()

    # 6. Syncs: oomguard's own count of its reads back from the device (step records'
    # d2h_reads, at most 1 a step) against CUDA's sync-debug mode (OOMGUARD_CUDA_SYNC_DEBUG=1:
    # the records' cuda_syncs, the training thread's synchronizing calls so far; the lines other
    # threads print to stderr counted too), 4 micro-batches a step, both losses and precisions.
    if want("syncs"):
        syncs = {}
        for prec in precisions:
            for loss in ("full", "fused"):
                d = work / f"syncs-{prec}-{loss}"
                d.mkdir()
                yaml = TINY.format(extra="").replace("vocab_size: 256}", f"vocab_size: 50257, loss: {loss}}}").replace(
                    "micro_batch_size: 16, grad_accum_steps: 1, max_steps: 3", f"micro_batch_size: 4, grad_accum_steps: 4, max_steps: 6, precision: {prec}")
                (d / "c.yaml").write_text(yaml)
                r = sh([og, "train", d / "c.yaml", "--run-dir", d / "run"], extra_env={"OOMGUARD_CUDA_SYNC_DEBUG": "1"})
                steps = step_records(d / "run")
                counts = [s.get("cuda_syncs") for s in steps]
                per_step = [b - a for a, b in zip(counts, counts[1:]) if a is not None and b is not None]
                syncs[f"{prec} {loss}"] = {"exit": r.returncode, "d2h_reads": [s.get("d2h_reads") for s in steps], "cuda_syncs_per_step": per_step,
                                           "stderr_sync_warnings": r.stderr.count("synchronizing CUDA operation")}
        checks["syncs per step"] = {"ok": all(v["exit"] == 0 and v["d2h_reads"] and all(n == 1 for n in v["d2h_reads"]) and v["cuda_syncs_per_step"] for v in syncs.values()),
                                    "by_run": syncs, "note": "cuda_syncs_per_step above d2h_reads are syncs inside libtorch's own kernels or elsewhere: read them"}
        save()

    # 7. Throughput: GPT-2 124M's shape, oomguard (model.loss full and fused) and eager PyTorch
    # (full logits) alternated, timed by window_rate on both sides, under the PYTORCH_ALLOC_CONF
    # oomguard logged, as MFU; the peak memory of each, and the largest micro-batch that fits.
    gpt2 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50257}
    peak = report["host"].get("mfu_peak_tflops")
    print(f"MFU peak: {peak['label']} (bf16 {peak['bf16']}, fp32 {peak['fp32']} dense TFLOP/s) for {report['host'].get('gpu')}" if peak
          else f"MFU peak: {report['host'].get('gpu')} with {report['host'].get('total_memory', 0) / 2**30:.1f} GiB is not in PEAKS: MFU not computed", flush=True)
    if want("throughput"):
        tp = {}
        for prec in precisions:
            shp = dict(gpt2, micro_batch_size=8, grad_accum_steps=4, steps=12, precision=prec)
            tokens_per_step = 8 * 4 * gpt2["block_size"]
            og_rates, og_peaks, eager_rates, eager_peaks, n_params, confs = {"full": [], "fused": []}, {"full": [], "fused": []}, [], [], None, []
            for rnd in range(2):
                for loss in ("full", "fused") if rnd % 2 == 0 else ("fused", "full"):
                    model = dict(gpt2, loss=loss)
                    code, steps, og_alloc = og_run(work / f"tp-{prec}-{loss}-{rnd}", f"model: {json.dumps(model)}\ndata: {{source: embedded, embedded_bytes: 8388608}}\ntrain: {{micro_batch_size: 8, grad_accum_steps: 4, max_steps: 12, eval_every: 0, device: cuda, precision: {prec}}}\nlog: {{every: 1}}\n")
                    if code == 0 and len(steps) == 12:
                        og_rates[loss].append(window_rate([s["elapsed_s"] for s in steps], tokens_per_step))
                        og_peaks[loss].append(max(s["memory"]["peak_bytes"] for s in steps))
                    confs.append({"oomguard": og_alloc})
                m = eager_run(shp, og_alloc)
                if m:
                    eager_rates.append(m["tokens_per_s"])
                    eager_peaks.append(m["peak_bytes"])
                    n_params = m["params"]
                confs[-1]["eager"] = m.get("alloc_conf")
            fpt = flops_per_token(gpt2, n_params) if n_params else None
            top = peak and peak["bf16" if prec == "bf16" else "fp32"]
            mfu = lambda r: r * fpt / (top * 1e12) if (top and fpt and r) else None
            med = lambda v: statistics.median(v) if v else None
            eager_tp = med(eager_rates)
            tp[prec] = {"eager_tokens_per_s": eager_tp, "eager_mfu": mfu(eager_tp), "eager_peak_bytes": max(eager_peaks, default=None),
                        "mfu_peak_tflops": top, "mfu_peak_label": peak and peak["label"], "alloc_conf": confs, "by_loss": {}}
            for loss in ("full", "fused"):
                og_tp = med(og_rates[loss])
                tp[prec]["by_loss"][loss] = {"oomguard_tokens_per_s": og_tp, "ratio": ratio(og_tp, eager_tp), "oomguard_mfu": mfu(og_tp),
                                             "oomguard_peak_bytes": max(og_peaks[loss], default=None), "rounds": og_rates[loss]}
            tp[prec]["rounds_eager"] = eager_rates
            checks["throughput gpt2-124m"] = {"ok": all(og_rates.values()) and all(c["oomguard"] == c.get("eager", c["oomguard"]) for c in confs), "by_precision": tp,
                                              "timing": "tokens/s over steps 2-11 of 12: wall clock between step ends (oomguard's: its one read a step, after the update; eager's: a device synchronise), on both sides"}
            save()

    # 8. The largest micro-batch that fits the card, GPT-2 124M at T 1024, per loss and
    # precision: micro_batch_size auto (real trial steps on the card) with global batch 512.
    if want("fit"):
        fit = {}
        for prec in precisions:
            for loss in ("full", "fused"):
                model = dict(gpt2, loss=loss)
                code, _, _ = og_run(work / f"fit-{prec}-{loss}", f"model: {json.dumps(model)}\ndata: {{source: embedded, embedded_bytes: 8388608}}\ntrain: {{micro_batch_size: auto, global_batch_size: 512, max_steps: 1, eval_every: 0, device: cuda, precision: {prec}}}\nmemory: {{auto_margin: 0.0}}\nlog: {{every: 1}}\n")
                rec = [json.loads(l) for l in (work / f"fit-{prec}-{loss}" / "run" / "metrics.jsonl").read_text().splitlines() if '"auto_micro_batch"' in l] if code == 0 else []
                fit[f"{prec} {loss}"] = rec[0].get("largest_fitting") if rec else None
            fit[f"{prec} fused/full"] = ratio(fit[f"{prec} fused"], fit[f"{prec} full"])
            checks["largest micro-batch gpt2-124m"] = {"ok": all(v for k, v in fit.items() if "/" not in k), "by_run": fit,
                                                       "how": "micro_batch_size: auto, global batch 512, T 1024: the largest size a real trial step fit"}
            save()

if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "host":
        host()
    elif cmd == "eager":
        eager(sys.argv[2])
    elif cmd == "peak":
        print(json.dumps(peak_for(sys.argv[2], int(sys.argv[3]))))
    elif cmd == "own-loop":
        own_loop(sys.argv[2], sys.argv[3], *sys.argv[4:])
    elif cmd == "own-fsdp2":
        own_fsdp2(*sys.argv[2:4])
    elif cmd == "own-fp16":
        own_fp16(*sys.argv[2:5])
    elif cmd == "check":
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {cmd!r}: host, eager SHAPE_JSON, peak NAME TOTAL_BYTES, check KIT OUT_DIR")
