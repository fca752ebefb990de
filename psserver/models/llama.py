"""``llama_tiny``: a small Llama-style decoder that fits the registry's classification interface;
``byte_lm``: the same blocks as a causal language model over bytes.

``Sequential(TokenEmbedding, DecoderBlock x N, ClassifierHead)``: every block takes and
returns one tensor, so the parameter server can split it into stages like any other model.
Blocks are pre-norm (RMSNorm), causal self-attention with rotary position embeddings (RoPE)
and a SwiGLU MLP; ``llama_tiny``'s head pools the sequence (mean over tokens) and classifies,
``byte_lm``'s predicts the next byte at every position (``--dataset pysource``).

Tensor parallelism (``TP_PLAN``, applied by ``psserver.collective.fsdp``) shards ``wq/wk/wv``
and ``w1/w3`` by columns and ``wo/w2`` by rows, Megatron style. Attention reshapes with ``-1`` heads so it
runs unchanged on the local slice of the heads; the tensor-parallel degree must divide the
number of heads (8), so up to 8 GPUs of a node can share each block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from psserver.models.registry import ModelSpec, check_spec

VOCAB = 256
SEQ_LEN = 32
DIM = 64
HEADS = 8
LAYERS = 2
HIDDEN = 128
NUM_CLASSES = 10

# Megatron-style tensor-parallel plan of each DecoderBlock: column-sharded projections in,
# row-sharded out. The degree must divide HEADS (attention runs on a slice of the heads).
TP_PLAN: tuple[str, dict[str, str]] = (
    "DecoderBlock",
    {
        "attention.wq": "colwise",
        "attention.wk": "colwise",
        "attention.wv": "colwise",
        "attention.wo": "rowwise",
        "feed_forward.w1": "colwise",
        "feed_forward.w3": "colwise",
        "feed_forward.w2": "rowwise",
    },
)


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` (batch, heads, seq, head_dim) by position-dependent angles."""
    _, _, seq, head_dim = x.shape
    half = head_dim // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TokenEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class ClassifierHead(nn.Module):
    """Final RMSNorm, mean over the sequence, linear classifier."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x).mean(dim=1))


def llama_tiny(
    vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, layers: int = LAYERS, hidden: int = HIDDEN,
    num_classes: int = NUM_CLASSES,
) -> nn.Sequential:
    """Embedding, ``layers`` decoder blocks, classifier head (~0.1M parameters by default)."""
    return _decoder(vocab, dim, heads, layers, hidden, ClassifierHead(dim, num_classes))


def _decoder(vocab: int, dim: int, heads: int, layers: int, hidden: int, head: nn.Module) -> nn.Sequential:
    """Embedding, ``layers`` decoder blocks, then ``head``: one tensor in and out of every stage."""
    if dim % heads or (dim // heads) % 2:
        raise ValueError(f"dim {dim} must split into {heads} heads of even size")
    return nn.Sequential(TokenEmbedding(vocab, dim), *[DecoderBlock(dim, heads, hidden) for _ in range(layers)], head)


LLAMA_TINY = check_spec(ModelSpec(
    "llama_tiny", llama_tiny, (SEQ_LEN,), NUM_CLASSES,
    f"Llama-style decoder ({LAYERS} blocks, dim {DIM}, RoPE, SwiGLU) over {SEQ_LEN} tokens",
    input_dtype=torch.long,
    tp_plan=TP_PLAN,
    tp_max_degree=HEADS,
))


class NextTokenHead(nn.Module):
    """Final RMSNorm and a linear map to the vocabulary at every position: ``[b, t, vocab]``."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


LM_SEQ_LEN = 128
LM_DIM = 192
LM_LAYERS = 4
LM_HIDDEN = 512


def byte_lm(dim: int = LM_DIM, heads: int = HEADS, layers: int = LM_LAYERS, hidden: int = LM_HIDDEN) -> nn.Sequential:
    """A causal byte-level decoder (about 1.8M parameters by default): embedding, ``layers``
    blocks, next-byte logits at every position."""
    return _decoder(VOCAB, dim, heads, layers, hidden, NextTokenHead(dim, VOCAB))


BYTE_LM = check_spec(ModelSpec(
    "byte_lm", byte_lm, (LM_SEQ_LEN,), VOCAB,
    f"causal byte-level decoder ({LM_LAYERS} blocks, dim {LM_DIM}, RoPE, SwiGLU) over {LM_SEQ_LEN} bytes",
    input_dtype=torch.long,
    tp_plan=TP_PLAN,
    tp_max_degree=HEADS,
    loss="next_token_cross_entropy",
    metric="loss",
))
