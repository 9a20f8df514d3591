"""Hugging Face `transformers` models from tiny configs (no download), as oomguard's Python
models: build(settings) makes a GPT2LMHeadModel or a LlamaForCausalLM; loss(module, batch) is
next-token cross-entropy on a token source's (inputs, targets)."""
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def config(arch, block, vocab=256):
    if arch == "gpt2":
        return GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=block, vocab_size=vocab,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if arch == "llama":
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=block)
    raise ValueError(f"unknown arch {arch!r}: gpt2 or llama")


def model_class(arch):
    return GPT2LMHeadModel if arch == "gpt2" else LlamaForCausalLM


def build(settings):
    arch = settings.get("arch", "gpt2")
    return model_class(arch)(config(arch, settings.get("block", 32)))


def loss(module, batch):
    x, y = batch
    logits = module(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
