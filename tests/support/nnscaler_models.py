"""Small real modules for the nnScaler API tests (test_nnscaler_core.py, test_nnscaler_samples.py, the trace unit tests): an LLM-like stack
of attention + MLP blocks in plain torch (with and without its loss), the document's End2EndMLP,
a module whose ``self.training`` changes its computation."""

import torch
import torch.nn.functional as F
from torch import nn

TOL = dict(rtol=1e-4, atol=1e-5)


class Attention(nn.Module):
    def __init__(self, d_model=16, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.q = nn.Linear(d_model, n_heads * self.head_dim)
        self.k = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)  # a key bias has a zero gradient
        self.v = nn.Linear(d_model, n_kv_heads * self.head_dim)
        self.o = nn.Linear(n_heads * self.head_dim, d_model)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class ManualAttention(nn.Module):
    """matmul -> scale -> causal mask -> softmax -> matmul, and a dropout only in training."""

    def __init__(self, d_model=16, n_heads=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv_q, self.qkv_v = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.qkv_k = nn.Linear(d_model, d_model, bias=False)  # a key bias has a zero gradient (AdamW would amplify noise)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q = self.qkv_q(x).view(b, s, self.n_heads, -1).permute(0, 2, 1, 3)
        k = self.qkv_k(x).view(b, s, self.n_heads, -1).permute(0, 2, 1, 3)
        v = self.qkv_v(x).view(b, s, self.n_heads, -1).permute(0, 2, 1, 3)
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.head_dim ** 0.5
        mask = x.new_ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        if self.training:
            probs = probs * 1.0
        out = torch.matmul(probs, v).transpose(1, 2).contiguous().view(b, s, d)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, d_model=16, hidden=32):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d_model, hidden), nn.Linear(d_model, hidden), nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d_model=16, manual=False):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = ManualAttention(d_model) if manual else Attention(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LLM(nn.Module):
    """Embedding, blocks, norm, head: the document's ``LLM``; ``forward(x)`` gives logits."""

    def __init__(self, vocab=32, d_model=16, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(Block(d_model, manual=i % 2 == 1) for i in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class End2EndLLM(LLM):
    """The LLM with its loss: ``forward(data)`` -> (loss, logits)."""

    def forward(self, data):
        logits = super().forward(data["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten())
        return loss, logits


class End2EndMLP(nn.Module):
    """The document's Example 3."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__()
        self.layers = torch.nn.ModuleList([])
        for _ in range(8):
            self.layers.append(nn.Linear(16, 16, bias=False))
        self.loss_fn = nn.BCELoss()

    def forward(self, data):
        x = data["data"]
        for layer in self.layers:
            x = layer(x)
        x = torch.sigmoid(x)
        return self.loss_fn(x, data["target"])


class Branchy(nn.Module):
    """``self.training`` changes the computation (nnScaler's limited support: one graph per mode)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = F.gelu(self.up(x))
        if self.training:
            h = h * 0.5
        return self.down(h)


class MaskAttention(nn.Module):
    """Attention as commonly written: sizes from ``x.shape`` / ``x.size``, ``view`` with computed
    sizes, SDPA with the decoder's boolean mask (``masked``) or ``is_causal``."""

    def __init__(self, d_model=16, n_heads=4, masked=True):
        super().__init__()
        self.n_heads, self.masked = n_heads, masked
        self.q, self.k, self.v = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model, bias=False), nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x, mask):
        B, S, D = x.shape
        head_dim = x.size(-1) // self.n_heads
        q = self.q(x).view(B, S, self.n_heads, head_dim).transpose(1, 2)
        k = self.k(x).view(B, S, self.n_heads, head_dim).transpose(1, 2)
        v = self.v(x).reshape(B, x.size(1), self.n_heads, -1).transpose(1, 2)
        if self.masked:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, S, D))


class MaskBlock(nn.Module):
    def __init__(self, d_model=16, masked=True):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn, self.mlp = MaskAttention(d_model, masked=masked), MLP(d_model)

    def forward(self, x, mask):
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class MaskDecoder(nn.Module):
    """A plain-PyTorch decoder: the causal mask ``torch.ones(S, S).tril()`` with ``S = x.shape[1]``,
    positions from ``torch.arange(S)``, the blocks of ``MaskBlock``; ``forward(data)`` -> (loss, logits)."""

    def __init__(self, vocab=32, d_model=16, layers=2, max_seq=16):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(max_seq, d_model)
        self.layers = nn.ModuleList(MaskBlock(d_model, masked=i % 2 == 0) for i in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, data):
        x = data["input_ids"]
        S = x.shape[1]
        mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        h = self.embed(x) + self.pos(torch.arange(S, device=x.device))
        for layer in self.layers:
            h = layer(h, mask)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten()), logits
