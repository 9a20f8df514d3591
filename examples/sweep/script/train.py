# A training script of your own, as W&B's agent runs it (`--lr=0.001 --hidden=64`), swept by
# `oomguard sweep examples/sweep/script/sweep.yaml`: each trial runs it under
# `oomguard launch` with OOMGUARD_RUN_DIR set, so the guard's metrics.jsonl (its losses, its
# OOMs) and `log_eval`'s val_loss land in the trial's directory, where the sweep reads them.
# `--scratch_mib` makes each sample need that much more memory in the forward pass (how a
# trial that does not fit even at micro-batch 1 looks: oomguard.Infeasible, exit 3).
import argparse, os, torch, oomguard

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--hidden", type=int, default=64)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--scratch_mib", type=float, default=0.0)
args = p.parse_args()
print("args:", vars(args), flush=True)

torch.manual_seed(0)
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    torch.distributed.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 1))
if torch.distributed.is_initialized():
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
w = torch.randn(16, 1)
data = lambda n: (lambda x: (x, x @ w))(torch.randn(n, 16))


def loss_fn(batch):
    x, y = batch
    if args.scratch_mib:  # a forward pass that needs scratch_mib per sample
        torch.empty(len(x), int(args.scratch_mib * 2**20) // 4)
    return torch.nn.functional.mse_loss(model(x), y)


guard = oomguard.Guard(model, global_batch_size=32)
for step in range(args.steps):
    loss = guard.backward(data(32), loss_fn)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if (step + 1) % 10 == 0:
        with torch.no_grad():
            guard.log_eval(loss_fn(data(256)).item())
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
