"""benches/python_model.rs's model: transformers' GPT2LMHeadModel at GPT-2 small's shape (12
layers, 12 heads, 768 wide, 50257 tokens; settings make it smaller), dropout off, built from
its config (no download), and next-token cross-entropy on (inputs, targets)."""
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def build(settings):
    vocab = settings.get("vocab", 50257)
    return GPT2LMHeadModel(GPT2Config(
        n_layer=settings.get("layers", 12), n_head=settings.get("heads", 12), n_embd=settings.get("width", 768),
        vocab_size=vocab, n_positions=settings.get("block", 256), bos_token_id=vocab - 1, eos_token_id=vocab - 1,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def loss(module, batch):
    x, y = batch
    return F.cross_entropy(module(input_ids=x).logits.flatten(0, 1), y.flatten())
