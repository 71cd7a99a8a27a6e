"""Expert parallelism: HF's fused experts split over the expert-parallel group (docs/moe.md).

Each rank of the expert group keeps ``E / ep`` consecutive experts of every fused experts module
(its 3-D ``gate_up_proj``/``down_proj`` and any other per-expert tensor, sliced along dim 0 and
marked with ``sharding.set_expert_parallel_attributes``). The router stays replicated and routes
this rank's tokens as in HF; the experts' ``forward`` becomes:

1. sort the (token, k) assignments by expert, count them per expert and exchange the counts
   (``backend.exchange_counts``: each rank learns what it receives, and for which local expert);
2. dispatch the token rows and their routing weights to the experts' owners
   (``backend.DispatchTokens``, all-to-alls with variable split sizes, one autograd node so that
   every rank runs their backward exchanges in the same order);
3. run HF's own experts ``forward`` on the received rows with top-k of 1 (local expert id, its
   weight), so each architecture's expert math (biases, clamped activations, ...) is kept;
4. send the outputs back (``backend.CombineTokens``) and sum each token's k rows, in expert order
   as HF does. Dropless, as HF: no capacity, no dropped tokens.

Identity experts (LongCat-Flash's ``zero_expert_num``, ids past the weighted experts) need no
weights: their assignments stay on the token's rank and run through HF's forward with the received
rows; ``gate_up_proj``'s unused slots for them stay in the last rank's block (docs/moe.md).

Under TP as well, the experts were first sharded over TP (``moe/tp_experts.py``): their tensors keep
those attributes and lose only experts here, and the TP region's hooks on the module wrap this
forward, so the region is entered before the dispatch (the TP ranks of a replica dispatch the same
rows over the expert groups of their TP position) and the row-parallel sum over TP runs once,
after the combine (docs/moe.md, "Tensor x expert parallelism").
"""

import inspect

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.moe.ep_dense import DENSE_EXPERTS, DenseExpertParallelForward
from nxd_hf.parallel_layers.sharding import (
    copy_tensor_model_parallel_attributes, is_sharded, set_expert_parallel_attributes,
)


def num_experts_of(name: str, module: nn.Module) -> int:
    """The number of (weighted) experts of a fused experts module: its ``num_experts`` (LongCat's
    ``num_routed_experts``), else dim 0 of its 3-D tensors."""
    for attr in ("num_experts", "num_routed_experts"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    sizes = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
    if len(sizes) != 1:
        raise ValueError(f"{name!r} ({type(module).__name__}): cannot tell its number of experts (no num_experts and "
                         "no 3-D expert tensors): expert parallelism needs HF's fused experts")
    return sizes.pop()


def identity_experts_of(module: nn.Module) -> int:
    """LongCat's zero-computation experts (ids past the weighted ones: the token passes through,
    scaled by its weight); its ``gate_up_proj`` also holds an unused slot for each of them."""
    return int(getattr(module, "zero_expert_num", 0) or 0)


def check_expert_parallel(experts: list[tuple[str, nn.Module]], ep: int) -> None:
    """ValueError, the same on every rank, when these experts cannot be split over ``ep`` ranks."""
    if not experts:
        raise ValueError(f"expert_parallel_size={ep} but the model has no mixture-of-experts layer (HF fused experts: "
                         "'moe_tp_experts' in its base_model_tp_plan or 'ep_dispatch_experts' in its base_model_ep_plan): "
                         "use expert_parallel_size=1")
    for name, module in experts:
        count = num_experts_of(name, module)
        if count % ep:
            raise ValueError(f"{name!r} has {count} experts, not divisible by expert_parallel_size={ep}: use an "
                             "expert_parallel_size dividing the number of experts")
        if type(module).__name__ in DENSE_EXPERTS:
            continue
        params = list(inspect.signature(type(module).forward).parameters)
        if len(params) < 4:  # self, hidden_states, top_k_index, top_k_weights
            raise ValueError(f"{name!r} ({type(module).__name__}) is not called with (hidden_states, top_k_index, "
                             "top_k_weights) as HF's fused experts are, nor is it a known dense experts module (every "
                             "token through every expert, moe/ep_dense.py): expert parallelism cannot dispatch its "
                             "tokens; use expert_parallel_size=1")


def apply_expert_parallel(experts: list[tuple[str, nn.Module]]) -> None:
    """Split every fused experts module over the expert-parallel group (module docstring), in place.
    Real weights keep this rank's experts; meta ones stay meta, shaped for them."""
    ep = parallel_state.get_expert_parallel_size()
    if ep == 1:
        return
    check_expert_parallel(experts, ep)
    rank, group = parallel_state.get_expert_parallel_rank(), parallel_state.get_expert_parallel_group()
    for _, module in experts:
        total, identity = num_experts_of("", module), identity_experts_of(module)
        local = total // ep
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0 or param.shape[0] not in (total, total + identity):
                continue
            assert not is_sharded(param) or param.partition_dim != 0, "TP shards the experts' rows, not dim 0"
            # the identity experts' unused slots (LongCat's gate_up_proj) stay with the last rank's block
            stop = param.shape[0] if rank == ep - 1 else (rank + 1) * local
            new = nn.Parameter(param.detach()[rank * local : stop].clone(), requires_grad=param.requires_grad)
            copy_tensor_model_parallel_attributes(new, param)  # TP rows (moe/tp_experts.py), partial-over-TP
            index = torch.arange(rank * local, stop, device="cpu")  # metadata, as shard_index
            set_expert_parallel_attributes(new, shard_index=index, logical_size=param.shape[0])
            setattr(module, pname, new)
        for attr in ("num_experts", "num_routed_experts"):
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, local)  # HF's forward one-hot encodes local ids
        if type(module).__name__ in DENSE_EXPERTS:
            module.forward = DenseExpertParallelForward(module.forward, num_local=local, ep=ep, group=group)
            continue
        if hasattr(module, "zero_expert_num"):  # LongCat: local ids past ``local`` are identity experts, plus a pad
            module.total_experts = local + identity + 1
        module.forward = ExpertParallelForward(module.forward, num_local=local, ep=ep, group=group,
                                               identity=identity, pad_top_k=hasattr(module, "zero_expert_num"))


class ExpertParallelForward:
    """The experts' ``forward`` under expert parallelism (steps 1-4 of the module docstring).
    ``identity``: the number of identity experts (ids from ``num_local * ep`` on), which need no
    weights: their rows stay on this rank and run through HF's forward with the received ones.
    ``pad_top_k``: HF's forward cannot take a top-k of 1 (LongCat's squeezes the k dim away), so
    each row gets a second choice of weight 0, the identity expert past the real ones (adds 0)."""

    def __init__(self, local_forward, *, num_local: int, ep: int, group, identity: int = 0, pad_top_k: bool = False):
        self.local_forward, self.num_local, self.ep, self.group = local_forward, num_local, ep, group
        self.identity, self.pad_top_k = identity, pad_top_k

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args,
                 **kwargs) -> torch.Tensor:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        k = top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)
        weighted = self.num_local * self.ep
        order = torch.argsort(experts, stable=True)  # assignments by expert: by owner, then local expert
        dispatched = int((experts < weighted).sum())  # identity experts sort last and stay here
        order, kept = order[:dispatched], order[dispatched:]
        token_of = order // k
        flat_weights = top_k_weights.reshape(-1).unsqueeze(1)
        device = backend.collective_device(self.group)
        per_expert = torch.bincount(experts[order], minlength=weighted).to(device)
        with backend.comm_tag("ep_counts"):
            received = backend.exchange_counts(per_expert, self.group).view(self.ep, self.num_local)  # [source, expert]
        send_splits = per_expert.view(self.ep, self.num_local).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        rows, weights = backend.DispatchTokens.apply(recv_splits, send_splits, self.group, hidden[token_of],
                                                     flat_weights[order])
        local_ids = torch.arange(self.num_local, device=received.device).repeat(self.ep).repeat_interleave(
            received.reshape(-1)).to(rows.device)
        if self.identity:  # local ids past num_local: HF's identity branch
            local_ids = torch.cat([local_ids, experts[kept].to(rows.device) - weighted + self.num_local])
            rows = torch.cat([rows, hidden[kept // k].to(rows.device, rows.dtype)])
            weights = torch.cat([weights, flat_weights[kept].to(weights.device, weights.dtype)])
        local_ids = local_ids.unsqueeze(1)
        if self.pad_top_k:
            local_ids = torch.cat([local_ids, torch.full_like(local_ids, self.num_local + self.identity)], 1)
            weights = torch.cat([weights, torch.zeros_like(weights)], 1)
        out = self.local_forward(rows, local_ids, weights, *args, **kwargs)
        if rows.requires_grad and not out.requires_grad:  # no rows here: the backward's all-to-alls still run
            out = out + rows.sum() * 0
        received_rows = int(received.sum())
        back = backend.CombineTokens.apply(send_splits, recv_splits, self.group, out[:received_rows])
        combined = torch.zeros_like(hidden).index_add_(0, token_of, back.to(hidden.dtype))
        if self.identity:
            combined = combined.index_add_(0, kept // k, out[received_rows:].to(hidden.dtype))
        return combined.reshape(shape)
