"""The glue `model.kind: python` runs in the embedded interpreter (src/task/python/glue.py),
loaded here as a plain module: activation checkpointing wraps a block under a private
attribute and restores exactly what was there (an instance-level `forward`, as PEFT or
accelerate hooks install, survives), and the buffers a step may change are the persistent
buffers only, never frozen parameters."""

from __future__ import annotations

import importlib.util

import torch

from conftest import ROOT

spec = importlib.util.spec_from_file_location("glue", ROOT / "src" / "task" / "python" / "glue.py")
glue = importlib.util.module_from_spec(spec)
spec.loader.exec_module(glue)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.frozen = torch.nn.Linear(4, 4, dtype=torch.float64).requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(4, dtype=torch.float64)
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(self.frozen(x)).pow(2).mean()


def grads(net, x):
    net.zero_grad()
    net(x).backward()
    return [p.grad.clone() for p in net.parameters() if p.requires_grad]


def test_checkpointing_keeps_an_instance_forward_and_restores_exactly_it():
    net = Net()
    calls = []
    original = net.blocks[0].forward

    def hook(x):  # an instance-level forward, as a PEFT or accelerate hook installs
        calls.append(1)
        return original(x)

    net.blocks[0].forward = hook
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads(net, x)
    m = glue.Model(net, None, "cpu")
    assert m.set_checkpointing(True, "Block") == 2
    calls.clear()
    got = grads(net, x)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert len(calls) == 2, "the hook ran in the forward and again in the recomputation"
    m.set_checkpointing(False, "Block")
    assert vars(net.blocks[0])["forward"] is hook, "the user's hook is back, not deleted"
    assert "forward" not in vars(net.blocks[1])
    assert not any(k.startswith("_oomguard") for b in net.blocks for k in vars(b))
    # On and off again: nothing stacks.
    m.set_checkpointing(True, "Block")
    m.set_checkpointing(True, "Block")
    m.set_checkpointing(False, "Block")
    assert vars(net.blocks[0])["forward"] is hook and "forward" not in vars(net.blocks[1])


def test_the_buffers_are_the_persistent_buffers_not_frozen_parameters():
    m = glue.Model(Net(), None, "cpu")
    assert [n for n, _ in m.buffers()] == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert "frozen.weight" in [n for n, _ in m.state()]
    assert "frozen.weight" not in [n for n, _ in m.parameters()]


def test_one_file_as_model_and_data_is_one_module(tmp_path):
    f = tmp_path / "both.py"
    f.write_text("RUNS = globals().get('RUNS', 0) + 1\nimport builtins\nbuiltins.oomguard_test_runs = getattr(builtins, 'oomguard_test_runs', 0) + 1\n")
    import builtins

    model = glue.load(str(f), "model.path", "model")
    data = glue.load(str(tmp_path / "." / "both.py"), "data.path", "data")
    assert model is data and builtins.oomguard_test_runs == 1
    other = tmp_path / "sub"
    other.mkdir()
    (other / "both.py").write_text("X = 2\n")
    third = glue.load(str(other / "both.py"), "data.path", "data")
    assert third is not model and third.X == 2 and third.__name__ != model.__name__
