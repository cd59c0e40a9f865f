"""A GPT-style decoder for tests and benchmarks: pre-norm blocks, causal attention, a GELU MLP, an untied
head. `GPT.from_size("130M")` gives the issue's reference size (768 wide, 12 layers, 32k vocabulary)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

SIZES = {
    # name: (vocab, width, layers, heads)
    "tiny": (96, 48, 2, 4),
    "20M": (8192, 384, 6, 6),
    "130M": (32000, 768, 12, 12),
}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """`forward(tokens)` returns the next-token cross-entropy over `tokens[:, 1:]`."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    @classmethod
    def from_size(cls, size: str, max_seq: int) -> GPT:
        if size not in SIZES:
            raise ValueError(f"size: {size!r} is not one of {', '.join(SIZES)}")
        return cls(*SIZES[size], max_seq=max_seq)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens[:, :-1]) + self.pos(torch.arange(tokens.shape[1] - 1, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


# name: (hidden, layers, heads, intermediate); LLaMA's shapes at the large end. The vocabulary is the
# caller's: LLaMA's 32,000 for the benchmark, 256 bytes for the training job's byte-level text.
LLAMA_SIZES = {
    "tiny": (64, 2, 4, 172),
    "20M": (512, 6, 8, 1376),
    "130M": (768, 12, 12, 2048),
    "350M": (1024, 24, 16, 2816),
    "1B": (2048, 16, 16, 5632),
    "3B": (3200, 26, 32, 8640),
    "7B": (4096, 32, 32, 11008),
}


def llama(size: str, vocab: int = 32000, max_seq: int = 2048) -> nn.Module:
    """A LLaMA-style decoder (Hugging Face `LlamaForCausalLM`, random initialization, untied head) of a
    size in `LLAMA_SIZES`: 130M is 768 wide with 12 layers, 7B is LLaMA-2 7B's shape."""
    if size not in LLAMA_SIZES:
        raise ValueError(f"size: {size!r} is not one of {', '.join(LLAMA_SIZES)}")
    # Imported here: transformers is needed by the benchmark and the training job only.
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, intermediate = LLAMA_SIZES[size]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_seq,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


# name: (tables, rows, width). Each table is one ZeRO-3 subgroup of 67M elements, 3.4x a `sub_group_size`
# of 2e7, as a 1B LLaMA's embedding is.
WIDE_SIZES = {
    "tiny": (3, 512, 64),
    "130M": (2, 32768, 2048),
    # What four ranks of DeepSpeed's NVMe offload (each near 3 GiB resident: every rank gathers the whole
    # model in forward and backward) and the RAM-backed test bed leave room for in 24 GiB (`make bench-node`).
    "270M": (4, 32768, 2048),
    "1B": (14, 32768, 2048),
    # Near the most DeepSpeed's NVMe offload holds in 24 GiB with the state in bf16 (about 12.8 bytes a
    # parameter resident at 940M, docs/results.md), ours beside it.
    "1.5B": (22, 32768, 2048),
    # The largest here: its bf16 parameters and fp32 state (14 bytes a parameter, 49 GB) twice this
    # machine's 24 GiB, trained with its parameters on NVMe too (docs/results.md).
    "3.5B": (52, 32768, 2048),
}


class WideTables(nn.Module):
    """Many parameters, little compute: embedding tables looked up by a few tokens and a small fp32 head,
    so the update phase dominates an iteration on any CPU as it does on a GPU (no large matrix product,
    in bf16 or otherwise). `forward(tokens)` returns a cross-entropy loss; every table gets a gradient
    (dense, as an `nn.Embedding`'s is)."""

    def __init__(self, tables: int, rows: int, width: int, classes: int = 16) -> None:
        super().__init__()
        self.rows = rows
        self.tables = nn.ModuleList(nn.Embedding(rows, width) for _ in range(tables))
        self.head = nn.Linear(width, classes)
        self.classes = classes

    @classmethod
    def from_size(cls, size: str) -> WideTables:
        if size not in WIDE_SIZES:
            raise ValueError(f"size: {size!r} is not one of {', '.join(WIDE_SIZES)}")
        return cls(*WIDE_SIZES[size])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens[:, :-1] % self.rows
        x = sum(table(ids).float() for table in self.tables)
        assert isinstance(x, torch.Tensor)
        logits = F.linear(x.mean(dim=1), self.head.weight.float(), self.head.bias.float())
        return F.cross_entropy(logits, tokens[:, -1] % self.classes)
