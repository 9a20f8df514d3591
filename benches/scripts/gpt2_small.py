"""benches/python_model.rs's model: transformers' GPT2LMHeadModel at GPT-2 small's shape (12
layers, 12 heads, 768 wide, 50257 tokens; a `layers` setting for a smaller one), dropout off,
built from its config (no download), and next-token cross-entropy on (inputs, targets)."""
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def build(settings):
    return GPT2LMHeadModel(GPT2Config(
        n_layer=settings.get("layers", 12), n_head=12, n_embd=768, vocab_size=50257,
        n_positions=settings.get("block", 256), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def loss(module, batch):
    x, y = batch
    return F.cross_entropy(module(input_ids=x).logits.flatten(0, 1), y.flatten())
