"""The activations of a training step, traced from the model itself rather than counted from its config.

One forward of the causal LM on the meta device (no memory, any size), in training mode and the
workload's dtype, batch and sequence length, with LoRA adapters when the workload has them,
records every tensor autograd saves for backward (``saved_tensors_hooks``), the decoder layer
that saved it and its bytes (views of one tensor counted once, parameters never). Whatever the
architecture does is what gets counted: GPT-2's Conv1D and its dropout masks, an eager or math
attention's seq x seq probabilities, gelu_new's intermediates, fused projections, experts.

To price a tensor-parallel rank from this one unsharded trace, each saved tensor carries where it
lives under TP: a dispatch mode follows the data from the parameters the TP plan shards. An op
that takes a column-parallel weight (or a fused expert's gate/up) starts a sharded activation of
that module; anything computed from it stays sharded with it; an op that takes a row-parallel
weight (the reduction back to hidden) ends it. A sharded tensor's bytes scale by the local share
of its source module's output rows (``RankParams.fractions``: padded query heads, replicated K/V
heads, strided fused projections); the others are replicated, and under sequence parallelism
split over tp, but for the input a column-parallel layer saves (the gathered sequence)."""

import contextlib
import dataclasses

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nxd_hf.architectures import get_patch
from nxd_hf.plan.shapes import POST, PRE, decoder_layers, meta_model
from nxd_hf.tp import plan as tp_plan
from nxd_hf.tp.apply import match_plan


@dataclasses.dataclass(frozen=True)
class Saved:
    """One tensor autograd keeps for backward."""

    place: int | str
    """Decoder layer index, PRE (embeddings) or POST (final norm, head)."""
    nbytes: int
    source: str | None
    """The column-parallel module (or experts) whose output it is part of; None: replicated."""
    gathered: bool
    """Saved by a column-parallel layer as its input: the whole sequence even under SP, where each
    such layer gathers (and saves) its own copy."""
    split: bool
    """Computed from the residual stream outside the sharded regions (norms, residual dropout):
    split over the sequence under SP (rotary tables and masks are not)."""
    key: int
    """The tensor (views share it): without SP, saved once however many layers save it."""


@dataclasses.dataclass
class ActivationTrace:
    """What one microbatch's forward saves, per place."""

    saved: list[Saved]
    reductions: dict = dataclasses.field(default_factory=dict)
    """Place -> the row-parallel layers (reductions back to the hidden size) whose forward has
    finished when that place saves its last tensor: what recomputing the layer (torch's
    non-reentrant checkpoint stops at its last saved tensor) runs again. One for a layer whose last
    save is its MLP's down projection input, two when a dropout after it saves a mask (GPT-2)."""

    def place_bytes(self, place, *, tp: int, sequence_parallel: bool, fractions: dict[str, float]) -> float:
        """Bytes one TP rank saves at ``place``."""
        total, counted = 0.0, set()
        for s in self.saved:
            if s.place != place or (s.key in counted and not (sequence_parallel and s.gathered)):
                continue
            counted.add(s.key)
            total += _rank_bytes(s, tp, sequence_parallel, fractions)
        return total

    def largest_bytes(self, place, *, tp: int, sequence_parallel: bool, fractions: dict[str, float]) -> float:
        """The largest single tensor one TP rank saves at ``place``: backward's gradients of it
        are the transient a layer's backward adds."""
        return max((_rank_bytes(s, tp, sequence_parallel, fractions) for s in self.saved if s.place == place),
                   default=0.0)


def _rank_bytes(s: Saved, tp: int, sequence_parallel: bool, fractions: dict[str, float]) -> float:
    if s.source is not None:
        return s.nbytes * fractions.get(s.source, 1.0 / tp)
    if sequence_parallel and s.split and not s.gathered:
        return s.nbytes / tp
    return s.nbytes


class _FusedAttention(torch.autograd.Function):
    """What a fused SDPA kernel (flash, memory-efficient, cuDNN) saves: q, k, v, its output and the
    fp32 log-sum-exp. A GPU kernel lays its output out [b, s, heads, d] (the transpose back to the
    projection is free); a CPU's follows the query's strides (a copy when they are [b, heads, s, d])."""

    @staticmethod
    def forward(ctx, query, key, value, like_query):
        b, heads, s, _ = query.shape
        if like_query and value.shape[-1] == query.shape[-1]:
            out = torch.empty_like(query)
        else:
            out = query.new_empty(b, s, heads, value.shape[-1]).transpose(1, 2)
        lse = query.new_empty(b, heads, s, dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("a plan's trace never runs backward")


class _Attention(TorchFunctionMode):
    """On the meta device SDPA always takes its math path, which saves the seq x seq probabilities:
    take the kernel the target device would (a CPU's choice asked of the CPU with tiny tensors of
    the same kind; a GPU's flash and memory-efficient kernels handle masks and dropout)."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or not self._fused(*args, **kwargs):
            return func(*args, **kwargs)
        query, key, value = args[:3] if len(args) >= 3 else (kwargs["query"], kwargs["key"], kwargs["value"])
        return _FusedAttention.apply(query, key, value, self.device == "cpu")

    def _fused(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False) -> bool:
        if self.device != "cpu":
            return True

        def tiny(t, rows):
            return torch.zeros(1, t.shape[1], rows, t.shape[-1], dtype=t.dtype, requires_grad=t.requires_grad)

        mask = None if attn_mask is None else torch.zeros(1, 1, 4, 4, dtype=attn_mask.dtype)
        choice = torch._fused_sdp_choice(tiny(query, 4), tiny(key, 4), tiny(value, 4), mask, dropout_p, is_causal,
                                         scale=scale, enable_gqa=enable_gqa)
        return choice != int(SDPBackend.MATH)


STREAM = ("s",)


class _Follow(TorchDispatchMode):
    """Tags each op's outputs: ("w", kind, name) a weight or a view of it, ("a", name) sharded by
    ``name``, STREAM computed from a decoder layer's input outside the sharded regions."""

    def __init__(self, weights: dict[int, tuple]):
        super().__init__()
        self.tags = dict(weights)
        self.keep = []  # the tagged tensors stay alive so that their ids stay theirs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        tags = [self.tags.get(id(t)) for t in inputs]
        weights = [t for t in tags if t and t[0] == "w"]
        if weights and len(weights) == len(inputs):
            tag = weights[0]  # a transpose or view of a weight
        elif weights:
            _, kind, name = weights[0]
            tag = ("a", name) if kind == "column" else STREAM  # a row-parallel output is the stream again
        else:
            tag = next((t for t in tags if t and t[0] == "a"), STREAM if STREAM in tags else None)
        if tag is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.tags[id(t)] = tag
                    self.keep.append(t)
        return out


def _sharded_modules(config, model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """name -> (kind, module) of the decoder's column/row-parallel layers and fused experts."""
    found = {}
    for name, module, style in match_plan(get_patch(config), model):
        if isinstance(style, (tp_plan.Column, tp_plan.Experts)):
            found[name] = ("column", module)
        elif isinstance(style, tp_plan.Row):
            found[name] = ("row", module)
    return found


def _weights(model: nn.Module, sharded: dict) -> dict[int, tuple]:
    tags = {}
    for name, (kind, _) in sharded.items():
        wrapper = model.get_submodule(name)  # with LoRA, the adapter's factors shard like the layer
        for pname, param in wrapper.named_parameters():
            down = "down" in pname.split(".")[-1]  # a fused expert block's reduction back to hidden
            tags[id(param)] = ("w", "row" if kind == "row" or down else "column", name)
    return tags


def trace_activations(config, *, micro_batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32,
                      lora_config=None, device: str = "cuda") -> ActivationTrace:
    """The tensors autograd saves in one training forward of ``config``'s causal LM (meta device),
    with the attention kernels of ``device`` ("cuda" or "cpu")."""
    model = meta_model(config).to(dtype)
    sharded = _sharded_modules(config, model)
    if lora_config is not None:
        import copy

        import peft

        wrapped = peft.get_peft_model(model, copy.deepcopy(lora_config))
        prefix = "base_model.model."
        model = wrapped
        sharded = {prefix + name: entry for name, entry in sharded.items()}
    model.train()
    patch = get_patch(config)
    layers = decoder_layers(model, patch)
    where, inside, handles, reduced, reductions = [PRE], [], [], [0], {}
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=index: _enter(i, args, kwargs), with_kwargs=True))
        handles.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, POST)))
    for name, (kind, _) in sharded.items():
        module = model.get_submodule(name)
        if kind == "column":
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: inside.append(n)))
            handles.append(module.register_forward_hook(lambda m, a, o: inside.pop() and None))
        else:
            handles.append(module.register_forward_hook(lambda m, a, o: reduced.__setitem__(0, reduced[0] + 1)))
    params = {id(p) for p in model.parameters()}
    follow = _Follow(_weights(model, sharded))

    def _enter(index, args, kwargs):
        where[0], reduced[0] = index, 0
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor):
            follow.tags[id(hidden)] = STREAM
            follow.keep.append(hidden)
    seen, saved = set(), []

    def pack(t):
        reductions[where[0]] = reduced[0]  # every save counts for the recomputation, parameters too
        root = t._base if t._base is not None else t
        if id(root) in params or follow.tags.get(id(root), ("",))[0] == "w":
            return t
        tag = follow.tags.get(id(t)) or follow.tags.get(id(root))
        gathered = bool(inside) and (tag is None or tag == STREAM)
        seen_as = (id(root), inside[-1] if gathered else None)
        if seen_as not in seen:
            seen.add(seen_as)
            follow.keep.append(root)
            saved.append(Saved(place=where[0], nbytes=root.untyped_storage().nbytes(), key=id(root),
                               source=_strip(tag[1]) if tag and tag[0] == "a" else None, gathered=gathered,
                               split=tag == STREAM))
        return t

    ids = torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _meta_experts(), _Attention(device), follow:
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return ActivationTrace(saved=saved, reductions=reductions)


@contextlib.contextmanager
def _meta_experts():
    """HF's fused experts call ``F.grouped_mm``, whose meta kernel takes bf16 only: on the meta
    device take transformers' own fallback op (a fake kernel of the same shapes, saving the same
    input and weight for backward)."""
    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without fused experts
        yield
        return
    original = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda input, weight, offs: not input.is_meta and original(input, weight, offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def _strip(name: str) -> str:
    return name.removeprefix("base_model.model.")
