"""Eager PyTorch doing what oomguard does, for the Python-model tests (tests/python_model.rs):
the module a model file's build(settings) makes after torch.manual_seed(seed), the same
samples, AdamW, schedule and clipping as ts_reference.py. Prints JSON on stdout.

  train:      the per-step losses of `steps` steps; `--out` saves the final state_dict
  pretrained: loads oomguard's model.safetensors with `from_pretrained` (transformers, the
              model file's config(arch, block)) and prints its eval loss and its largest
              difference from the weights it loaded
"""
import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(__file__))
from ts_reference import Text, positions, splitmix64, train  # noqa: E402


def load(path):
    spec = importlib.util.spec_from_file_location("model_file", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "pretrained"])
    ap.add_argument("--file", required=True, help="the model file")
    ap.add_argument("--settings", default="{}", help="JSON: build's settings")
    ap.add_argument("--config", required=True, help="JSON: data, seed, global_batch, ...")
    ap.add_argument("--weights", help="pretrained: oomguard's model.safetensors")
    ap.add_argument("--out", help="train: where to save the final state_dict (safetensors)")
    a = ap.parse_args()
    c, settings, f = json.loads(a.config), json.loads(a.settings), load(a.file)
    torch.set_num_threads(1)
    data = Text(c["data"], c["block"], c["val_fraction"])
    loss_of = getattr(f, "loss", None) or (lambda m, b: m(*b))
    if a.mode == "pretrained":
        arch = settings.get("arch", "gpt2")
        with tempfile.TemporaryDirectory() as d:
            f.config(arch, settings.get("block", 32)).save_pretrained(d)
            shutil.copy(a.weights, os.path.join(d, "model.safetensors"))
            model = f.model_class(arch).from_pretrained(d)
        saved = load_file(a.weights)
        state = model.state_dict()
        diff = max((state[k] - v).abs().max().item() for k, v in saved.items() if k in state)
        model.eval()
        seed = splitmix64(c["seed"] ^ 0xE7A1)
        with torch.no_grad():
            x, y = data.batch("val", positions(seed, 0, c["eval_batch"], data.count("val")))
            val = loss_of(model, (x, y)).item()
        print(json.dumps({"val_loss": val, "max_diff": diff, "loaded": len(saved)}))
        return
    torch.manual_seed(c["seed"])
    model = f.build(dict(settings))
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    losses = train(model, named, data, c, loss_of)
    if a.out:
        save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, a.out)
    print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
