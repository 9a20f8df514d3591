"""oomguard inside your own PyTorch loop: OOMs recovered in-process.

    guard = oomguard.Guard(model, global_batch_size=G, micro_batch_size=M)
    loss = guard.backward(batch, loss_fn)  # every .grad as one backward of the whole batch
    optimizer.step()                       # yours (or guard.optimizer_step(optimizer): its OOMs too)

The decisions (halve, grow back, cool down, give up) are the runtime's own policy, the
`oomguard-policy` crate compiled into `oomguard._native`; this package does the torch work
with the torch you have (>= 2.1; the wheel links none). See docs/own-loop.md.
"""

from typing import Any

from ._native import Policy, classify_oom, malloc_trim

__all__ = ["Guard", "Infeasible", "Policy", "Unsupported", "classify_oom", "is_oom", "malloc_trim"]
__version__ = "0.1.0"

_TORCH_PART = ("Guard", "Infeasible", "Unsupported", "is_oom")


def __getattr__(name: str) -> Any:
    # The guard imports torch when first used, so that the policy alone works without it.
    if name in _TORCH_PART:
        try:
            import torch  # noqa: F401 - the guard's, the user's own
        except ImportError as e:
            if e.name != "torch":
                raise  # torch is there, and failed to import: its own error says why
            raise ImportError(
                f"oomguard.{name} needs PyTorch (2.1 or later) in this environment: pip install torch "
                "(oomguard installs none of its own, so that your torch and its CUDA build stay as they are)",
                name="torch",
            ) from e
        from . import _guard

        return getattr(_guard, name)
    raise AttributeError(f"module 'oomguard' has no attribute {name!r}")
