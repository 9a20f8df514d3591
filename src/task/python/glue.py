"""oomguard's Python side of `model.kind: python`, run by the interpreter embedded in
oomguard-torch (src/task/python/mod.rs). It loads the user's files, calls their functions,
and hands tensors back as they are (the same at::Tensor on both sides, no copy).

Invariant: nothing here keeps a reference to a forward's tensors once it returns or raises:
an OOM's traceback (and its frames' activations) is dropped before the guard retries.
"""
import importlib.util
import os
import random
import warnings
import sys
import traceback
from collections.abc import Mapping

import torch


class UserError(Exception):
    """Bad input, refused with exit 2: `key` is the config key, the message says the fix."""

    def __init__(self, key, message):
        super().__init__(message)
        self.key = key
        self.message = message


def _venv_pip():
    # site-packages -> lib/pythonX.Y -> lib -> the venv
    site = os.environ.get("OOMGUARD_PYTHON_SITE_PACKAGES", "")
    venv = os.path.dirname(os.path.dirname(os.path.dirname(site))) if site else ""
    return os.path.join(venv, "bin", "python3") + " -m pip install" if venv else "pip install"


def _short_traceback(exc, tb=None):
    """The traceback's frames in the user's files and the error line, without ours."""
    frames = [
        f for f in traceback.extract_tb(tb or exc.__traceback__)
        if f.filename != __file__ and not f.filename.startswith("<frozen")
    ]
    lines = traceback.format_list(frames) + traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip()


# The user's files already executed, by real path: one file named as both `model.path` and
# `data.path` is one module, executed once (its globals shared, as a Python import would).
_LOADED = {}


def load(path, key, what):
    """Executes the user's file as a module of its own (once per file); its folder goes on
    sys.path, so that its own imports of files beside it work."""
    real = os.path.realpath(path)
    if real in _LOADED:
        return _LOADED[real]
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    stem = "oomguard_user_" + os.path.splitext(os.path.basename(path))[0]
    name, n = stem, 1
    while name in sys.modules and getattr(sys.modules[name], "__file__", None) != real:
        n += 1
        name = f"{stem}_{n}"
    spec = importlib.util.spec_from_file_location(name, real)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise UserError(key, f"{path} has a syntax error, line {e.lineno}: {e.msg}\n{_short_traceback(e)}") from None
    except ModuleNotFoundError as e:
        package = (e.name or "?").split(".")[0]
        raise UserError(
            key,
            f"{path} imports `{package}`, which the venv oomguard runs in lacks: install it with "
            f"`{_venv_pip()} {package}` (or point OOMGUARD_VENV at a venv that has it and the same torch)",
        ) from None
    except Exception as e:  # noqa: BLE001 (any failure while loading is the file's)
        raise UserError(key, f"{path} raised {type(e).__name__} while loading:\n{_short_traceback(e)}") from None
    _LOADED[real] = module
    return module


def function(module, path, name, key, what):
    f = getattr(module, name, None)
    if not callable(f):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UserError(
            key,
            f"{path} has no function `{name}` ({what}); its functions: {', '.join(found) or 'none'}",
        )
    return f


def build_model(path, build, loss, settings, device):
    module_file = load(path, "model.path", "model")
    make = function(module_file, path, build, "model.build", "build(settings) -> torch.nn.Module")
    loss_fn = function(module_file, path, loss, "model.loss", "loss(module, batch)") if loss else None
    try:
        module = make(dict(settings))
    except Exception as e:  # noqa: BLE001
        if isinstance(e, torch.OutOfMemoryError):
            raise
        raise UserError("model.build", f"{path}: {build}(settings) raised:\n{_short_traceback(e)}") from None
    if not isinstance(module, torch.nn.Module):
        raise UserError(
            "model.build",
            f"{path}: {build}(settings) returned {type(module).__name__}; it must return a torch.nn.Module",
        )
    # The optimizer's state is sized from the parameters as built: a lazy one (LazyLinear)
    # would grow under its moments at the first forward.
    from torch.nn.parameter import is_lazy

    lazy = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if is_lazy(t)]
    if lazy:
        raise UserError(
            "model.build",
            f"{path}: {build}(settings) returned a module with uninitialized lazy parameters ({', '.join(lazy[:3])}): "
            "give their sizes (nn.Linear, not nn.LazyLinear), or run one forward on a dummy batch inside build()",
        )
    # What checkpoints hold: safetensors has no complex or float8 dtype.
    odd = [
        f"{n} ({t.dtype})"
        for n, t in module.state_dict(keep_vars=True).items()
        if isinstance(t, torch.Tensor) and (t.is_complex() or "float8" in str(t.dtype))
    ]
    if odd:
        raise UserError(
            "model.build",
            f"{path}: {build}(settings) returned a module whose state holds {', '.join(odd[:3])}, which a checkpoint "
            "(safetensors) cannot store: register such a buffer with persistent=False (rebuilt by build), or keep "
            "it as torch.view_as_real(...)",
        )
    # AdamW keeps each trainable parameter's moments in its own dtype: no fp32 master weights
    # for a module cast to bf16 or fp16, and CUDA's fused update takes one dtype for all.
    kinds = sorted({str(p.dtype) for p in module.parameters() if p.requires_grad})
    low = [k for k in kinds if k in ("torch.bfloat16", "torch.float16")]
    if len(kinds) > 1 and torch.device(device).type == "cuda":
        raise UserError(
            "model.build",
            f"{path}: {build}(settings) returned trainable parameters of several dtypes ({', '.join(kinds)}), which "
            "CUDA's fused AdamW update cannot take together: keep the module in fp32 and set train.precision: bf16 "
            "(autocast, fp32 master weights)",
        )
    if low:
        warnings.warn(
            f"oomguard: {build}(settings) returned trainable parameters in {', '.join(low)}: their AdamW moments and "
            "updates are in that dtype too (no fp32 master weights); for those, keep the module in fp32 and set "
            "train.precision: bf16",
            stacklevel=1,
        )
    return Model(module.to(device), loss_fn, device)


def _loss_of(out):
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    raise UserError(
        "model.loss",
        f"the module returned {type(out).__name__}, not a loss: return the scalar mean loss, an object with "
        "`.loss` or a mapping with 'loss', or name a loss(module, batch) function in model.loss",
    )


def _fields_to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _fields_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_fields_to(v, device) for v in batch)
    return batch


class Model:
    def __init__(self, module, loss_fn, device):
        self.module = module
        self.loss_fn = loss_fn
        self.device = device
        self.training = None
        self.blocks = []
        # The tensors the runtime holds (read once, at build): a module that replaces one (a
        # buffer assigned anew, `self.ema = self.ema * d + ...`) or unfreezes a parameter would
        # train, save and restore what it no longer uses. Checked after the first forwards,
        # then every CHECK_EVERY-th.
        self._held = None
        self._trainable = None
        self._calls = 0

    def parameters(self):
        params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self._trainable = {id(p) for _, p in params}
        return params

    def state(self):
        # keep_vars: the parameters themselves; tied weights appear under each name.
        state = [(n, t) for n, t in self.module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)]
        self._held = dict(state)
        return state

    def _check_held(self):
        # Parameters and buffers only: a state_dict's extras (bitsandbytes' quant_state, an
        # `_extra_state`) are made anew at each call, by design.
        for n, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
            held = self._held.get(n)
            if held is not None and t is not held:
                leaf = n.rsplit(".", 1)[-1]
                raise UserError(
                    "model.path",
                    f"the module replaced `{n}` with a new tensor during training: oomguard trains, saves and restores "
                    f"the tensors the module held when build() returned; update it in place (self.{leaf}.mul_(d).add_(x), "
                    f"or self.{leaf}.copy_(new))",
                )
        for n, p in self.module.named_parameters():
            if p.requires_grad and id(p) not in self._trainable:
                raise UserError(
                    "model.path",
                    f"parameter `{n}` requires grad now but did not when build() returned: oomguard's optimizer trains "
                    "the parameters that required grad then; unfreeze it inside build(), or train it in another run",
                )

    def buffers(self):
        # The persistent buffers (BatchNorm's statistics): what a step changes besides the
        # trained parameters. Frozen parameters are not among them (they are in `state`).
        saved = set(self.module.state_dict(keep_vars=True))
        return [(n, b) for n, b in self.module.named_buffers() if n in saved]

    def loss(self, batch, train):
        if self.training is not train:
            self.module.train(train)
            self.training = train
        batch = _fields_to(batch, self.device)
        if self.loss_fn is not None:
            out = self.loss_fn(self.module, batch)
        elif isinstance(batch, Mapping):
            out = self.module(**batch)
        elif isinstance(batch, (tuple, list)):
            out = self.module(*batch)
        else:
            out = self.module(batch)
        if train and self._held is not None and self._trainable is not None:
            self._calls += 1
            if self._calls <= 3 or self._calls % CHECK_EVERY == 0:
                self._check_held()
        return _loss_of(out)

    # Activation checkpointing: each block's forward recomputed in backward.
    def find_blocks(self, class_name):
        if class_name:
            return [m for m in self.module.modules() if type(m).__name__ == class_name]
        best = []
        for m in self.module.modules():
            if isinstance(m, torch.nn.ModuleList) and len(m) > 1 and len({type(b) for b in m}) == 1:
                if len(m) > len(best):
                    best = list(m)
        return best

    def set_checkpointing(self, on, class_name):
        import torch.utils.checkpoint as ckpt

        if not self.blocks:
            self.blocks = self.find_blocks(class_name)
        # A transformers model keeps a KV cache in training when its config says use_cache: the
        # blocks' recomputation in backward would update it a second time. Off while
        # checkpointing, as its own gradient_checkpointing_enable() has it, and back after.
        config = getattr(self.module, "config", None)
        if on and getattr(config, "use_cache", None) is True:
            config.use_cache = False
            self._use_cache = True
        elif not on and getattr(self, "_use_cache", False):
            config.use_cache = True
            self._use_cache = False
        for block in self.blocks:
            # What the block's instance had as `forward` before (a PEFT or accelerate hook is
            # one), kept under a private attribute: turning it off restores exactly that.
            wrapped = _CKPT_ATTR in vars(block)
            if on and not wrapped:
                before = vars(block).get("forward", _NONE)
                inner = block.forward

                def forward(*args, _inner=inner, **kwargs):
                    if not torch.is_grad_enabled():
                        return _inner(*args, **kwargs)
                    return ckpt.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

                object.__setattr__(block, _CKPT_ATTR, before)
                block.forward = forward
            elif not on and wrapped:
                before = vars(block)[_CKPT_ATTR]
                object.__delattr__(block, _CKPT_ATTR)
                if before is _NONE:
                    del block.forward
                else:
                    block.forward = before
        return len(self.blocks)


# Training forwards between checks that the module still holds the tensors it was built with.
CHECK_EVERY = 64

# Activation checkpointing's mark on a block: what its instance's `forward` was before.
_CKPT_ATTR = "_oomguard_checkpointed_forward"
_NONE = object()


def _stack(field):
    first = field[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(field)
    if isinstance(first, Mapping):
        return {k: _stack([f[k] for f in field]) for k in first}
    return torch.as_tensor(field)


def default_collate(items):
    first = items[0]
    if isinstance(first, (tuple, list)):
        return tuple(_stack(list(f)) for f in zip(*items))
    return _stack(items)


class Data:
    """The train and val datasets a data file builds, and how a batch is made of items."""

    def __init__(self, path, build, settings):
        data_file = load(path, "data.path", "data")
        make = function(data_file, path, build, "data.build", "build(settings, split) -> a map-style dataset")
        self.collate = getattr(data_file, "collate", None) or default_collate
        self.units = getattr(data_file, "loss_units", None)
        if self.units is not None and not callable(self.units):
            raise UserError("data.path", f"{path}: loss_units is not a function; define loss_units(batch) -> the number of targets the loss averages over in the batch")
        self.splits = []
        for split in ("train", "val"):
            try:
                ds = make(dict(settings), split)
            except Exception as e:  # noqa: BLE001
                raise UserError("data.build", f"{path}: {build}(settings, {split!r}) raised:\n{_short_traceback(e)}") from None
            if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
                raise UserError(
                    "data.build",
                    f"{path}: {build}(settings, {split!r}) returned {type(ds).__name__}; it must return a map-style "
                    "dataset (with __len__ and __getitem__)",
                )
            if len(ds) < 1:
                raise UserError("data.build", f"{path}: {build}(settings, {split!r}) returned an empty dataset")
            self.splits.append(ds)

    def len(self, split):
        return len(self.splits[split])

    def batch(self, split, indices):
        ds = self.splits[split]
        return self.collate([ds[i] for i in indices])

    def count_units(self, batch):
        """The data file's `loss_units(batch)` of a batch already built (the one the loss is
        computed on), as a count."""
        n = int(self.units(batch))
        if n < 0:
            raise ValueError(f"loss_units(batch) returned {n}; it must be 0 or more")
        return n


def _numpy_random():
    """numpy's global generator (`np.random`), when numpy is installed."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


def seed_host(seed):
    """numpy's global generator seeded from the run's seed, as Python's `random` is: a model or
    dataset that draws from it is the same run to run."""
    np_random = _numpy_random()
    if np_random is not None:
        np_random.seed(seed % (1 << 32))


def seed_host_all(seed):
    """Python's `random` and numpy's global generator seeded for this attempt of a step."""
    random.seed(seed)
    seed_host(seed)


def python_rng_state():
    """The host generators a model may draw from: Python's `random` and numpy's global one."""
    version, internal, gauss = random.getstate()
    state = {"random": [version, list(internal), gauss]}
    np_random = _numpy_random()
    if np_random is not None:
        kind, keys, pos, has_gauss, cached = np_random.get_state()
        state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return state


def set_python_rng_state(state):
    if isinstance(state, list):  # a checkpoint from before numpy's state was kept
        state = {"random": state}
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state.get("numpy")
    np_random = _numpy_random()
    if np_state is not None and np_random is not None:
        import numpy

        kind, keys, pos, has_gauss, cached = np_state
        np_random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))
