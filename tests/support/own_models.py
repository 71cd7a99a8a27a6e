"""A user's own decoder (no Hugging Face class), written NxD's way with nxd_hf's parallel layers
(``parallel=True``: ParallelEmbedding, Column/RowParallelLinear, parallel_cross_entropy) or with
plain torch layers (``parallel=False``), under the same parameter names; the plain one built
with a seed is the one-process reference, and ``build`` copies its weights into either kind."""

import torch
import torch.nn.functional as F
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.parallel_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, parallel_cross_entropy
from nxd_hf.parallel_layers.sharding import shard_from_full

VOCAB, HIDDEN, HEADS, LAYERS = 64, 16, 4, 4


def _linear(parallel: bool, kind: str, n_in: int, n_out: int) -> nn.Module:
    if not parallel:
        return nn.Linear(n_in, n_out, bias=False)
    if kind == "column":
        return ColumnParallelLinear(n_in, n_out, bias=False, gather_output=False)
    return RowParallelLinear(n_in, n_out, bias=False, input_is_parallel=True)


class Block(nn.Module):
    """Causal self-attention and an MLP, each a column -> row pair."""

    def __init__(self, parallel: bool):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_size() if parallel else 1
        self.num_heads = HEADS // tp  # this rank's heads
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v = (_linear(parallel, "column", HIDDEN, HIDDEN) for _ in range(3))
        self.o = _linear(parallel, "row", HIDDEN, HIDDEN)
        self.up, self.down = _linear(parallel, "column", HIDDEN, 4 * HIDDEN), _linear(parallel, "row", 4 * HIDDEN, HIDDEN)

    def forward(self, h):
        b, s, _ = h.shape
        x = self.norm1(h)
        q, k, v = (proj(x).view(b, s, self.num_heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads/tp, s, d]
        h = h + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class OwnDecoder(nn.Module):
    """``forward(input_ids, labels)`` -> the mean next-token loss over labels != -100."""

    def __init__(self, parallel: bool):
        super().__init__()
        self.parallel = parallel
        self.embed = ParallelEmbedding(VOCAB, HIDDEN) if parallel else nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(parallel) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = _linear(parallel, "column", HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))[:, :-1]  # [b, s-1, vocab/tp] under TP
        labels = labels[:, 1:]
        if self.parallel:
            per_token = parallel_cross_entropy(logits, labels.clamp(min=0))
        else:
            per_token = F.cross_entropy(logits.reshape(-1, VOCAB), labels.clamp(min=0).reshape(-1),
                                        reduction="none").view(labels.shape)
        mask = (labels != -100).to(per_token.dtype)
        return (per_token * mask).sum() / mask.sum()


def reference(seed: int = 0) -> OwnDecoder:
    torch.manual_seed(seed)
    return OwnDecoder(parallel=False)


def build(parallel: bool, seed: int = 0) -> OwnDecoder:
    """An ``OwnDecoder`` holding (its shards of) ``reference(seed)``'s weights: the config API's model_fn."""
    full = dict(reference(seed).named_parameters())
    model = OwnDecoder(parallel)
    with torch.no_grad():
        for name, param in model.named_parameters():
            sharded = getattr(param, "tensor_model_parallel", False)
            param.copy_(shard_from_full(full[name], param.partition_dim, param.shard_index) if sharded else full[name])
    return model


def batch(seed: int, b: int = 8, s: int = 8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    return ids, ids.clone()  # no ignored labels: each rank's and microbatch's mean is then the batch's


PIPELINE = {"num_microbatches": 2, "transformer_layer_cls": Block, "input_names": ["input_ids", "labels"]}
"""``pipeline_config`` for ``OwnDecoder`` (NxD's arguments for a model that is not Hugging Face's)."""
