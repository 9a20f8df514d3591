# Your own loop with `import oomguard` (docs/own-loop.md). With the set-up's venv:
#   OOMGUARD_RUN_DIR=runs/own .venv/bin/python examples/python/own_loop.py   (metrics.jsonl there)
#   PATH=$PWD/.venv/bin:$PATH ./target/release/oomguard launch --nproc-per-node 2 \
#     examples/python/own_loop.py                                           (data parallel)
import os, torch, oomguard

if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    torch.distributed.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
if torch.distributed.is_initialized():
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
guard = oomguard.Guard(model, global_batch_size=64, micro_batch_size=64)
for step in range(20):
    x, y = torch.randn(64, 32), torch.randn(64, 1)  # this rank's rows
    loss = guard.backward((x, y), lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]))
    opt.step()  # yours, as before
    opt.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss:.4f} micro_batch_size={guard.micro_batch_size}")
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
