"""LoRA for ``ColumnParallelLinear`` / ``RowParallelLinear``: peft's ``lora.Linear`` with
sharded adapters, created by peft's own ``get_peft_model`` / ``inject_adapter_in_model``
through the dispatch registered in ``nxd_hf.lora.dispatch``.

Column-parallel base ``Y_i = X W_i^T``: ``A`` [r, in] replicated, ``B`` sharded like the base
rows (same ``shard_index``: padding rows zero, replicated K/V rows with their gradients summed
like the base's). ``Y_i += s * (X A^T) B_i^T`` before any output gather. ``A``'s gradient on
a rank covers only its own ``B_i`` rows, so it is summed over TP after backward.

Row-parallel base ``Y = sum_i X_i W_i^T``: ``A`` sharded like the base columns, ``B`` [out, r]
replicated. ``s * (X_i A_i^T) B^T`` is added to the base's partial sum before its all-reduce
(reduce-scatter under SP), the bias after; ``B``'s gradient is partial and summed over TP.

Both start from the full ``A`` and ``B`` peft itself creates (same RNG draws as on the
unsharded model) and keep this rank's slice, so with the same seed they equal plain peft's.
"""

import torch
import torch.nn.functional as F
from peft.tuners.lora import layer as peft_lora
from torch import nn

from nxd_hf.parallel_layers import ColumnParallelLinear, RowParallelLinear, mappings
from nxd_hf.parallel_layers.sharding import (
    local_rows_mask, mark_partial_grad_over_tp, set_tensor_model_parallel_attributes, shard_from_full,
)

SUPPORTED_INITS = (True, False, "gaussian")
_WEIGHT_INITS = {  # peft's other inits: what makes them need the whole layer (or data) on one process
    "olora": "rewrites the base weight from a QR decomposition of the whole weight",
    "pissa": "rewrites the base weight from an SVD of the whole weight",
    "corda": "rewrites the base weight from an SVD of the whole weight and activation statistics",
    "loftq": "quantizes the whole base weight and initializes from its quantization error",
    "eva": "initializes A from SVDs of the layer's activations on data batches (initialize_lora_eva_weights)",
    "orthogonal": "draws orthogonal A and B from a QR decomposition of the whole adapter shapes",
    "lora_ga": "initializes from the gradients of the whole weight",
    "mica": "initializes from the whole base weight",
}


def check_supported_init(config) -> None:
    """ValueError naming an ``init_lora_weights`` nxd_hf cannot make equal plain peft's."""
    init = config.init_lora_weights
    if init in SUPPORTED_INITS:
        return
    key = next((k for k in _WEIGHT_INITS if isinstance(init, str) and init.lower().startswith(k)), None)
    why = _WEIGHT_INITS.get(key, "is not one nxd_hf implements")
    raise ValueError(
        f"LoRA init_lora_weights={init!r} is not supported on an nxd_hf parallel model: it {why}, which a rank "
        "holding a shard or a pipeline stage cannot do as plain peft does. Use init_lora_weights=True (peft's "
        "default) or 'gaussian', which equal plain peft at every layout; or initialize with plain peft on the "
        "unparallelized model, save the adapter converted to a plain LoRA (peft's save_pretrained(..., "
        "path_initial_model_for_weight_conversion=...)) and load it into the parallel model with the base "
        "it applies to")


def check_supported_config(config, where: str) -> None:
    """ValueError for peft options these layers do not implement."""
    unsupported = {
        "use_dora": config.use_dora, "lora_bias": config.lora_bias,
        "init_lora_weights": config.init_lora_weights not in SUPPORTED_INITS,
        "use_bdlora": getattr(config, "use_bdlora", None), "velora_config": getattr(config, "velora_config", None),
        "alora_invocation_tokens": getattr(config, "alora_invocation_tokens", None),
        "arrow_config": getattr(config, "arrow_config", None), "mica": getattr(config, "mica", None),
        "monteclora_config": getattr(config, "monteclora_config", None),
        "kasa_config": getattr(config, "kasa_config", None),
    }
    check_supported_init(config)
    bad = sorted(name for name, value in unsupported.items() if value)
    if bad:
        raise ValueError(
            f"LoRA on nxd_hf's parallel layers ({where}) does not support {bad} (e.g. DoRA): only plain LoRA with "
            f"init_lora_weights in {SUPPORTED_INITS}, use_rslora and lora_dropout. Turn these options off"
        )


class _ParallelLoraLinear(peft_lora.Linear):
    """Shared by both layers: peft's bookkeeping (adapters, scaling, merge, disable), our math.
    The forwards read ``self.base_layer``, the parallel layer itself (the dispatch wraps only
    those), not peft's ``get_base_layer()``, whose search costs two failed attribute lookups: they
    run for every adapted layer on every step."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, **kwargs):
        check_supported_config(config, type(base_layer).__name__)
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self.fan_in_fan_out = False  # nxd_hf stores every base weight [out, in], Conv1D's too

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        check_supported_config(config, type(self.get_base_layer()).__name__)
        super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)  # full A [r, in], B [out, r]
        self.shard_adapter(adapter_name)
        for linear in (self.lora_A[adapter_name], self.lora_B[adapter_name]):
            if type(linear) is nn.Linear:
                linear.__class__ = _AdapterLinear

    def shard_adapter(self, adapter_name: str) -> None:
        raise NotImplementedError

    def _mixed_batch_forward(self, *args, **kwargs):
        raise ValueError("adapter_names (mixed adapter batches) is not supported on nxd_hf's parallel layers")

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            self._mixed_batch_forward()
        if self.disable_adapters and self.merged:
            self.unmerge()
        active = () if self.disable_adapters or self.merged else self._active_lora_adapters()
        if not active:
            return self.base_layer(x, *args, **kwargs)
        return self.forward_with_adapters(x, active)

    def _active_lora_adapters(self) -> list[str]:
        return [name for name in self.active_adapters if name in self.lora_A]


class _AdapterLinear(nn.Linear):
    """An adapter's ``nn.Linear`` whose weight keeps its sharding metadata when replaced by a new
    Parameter of the same shape: peft's ``cast_adapter_dtype`` (fp32 adapters on a bf16 model,
    ``get_peft_model``'s default) re-creates the adapter weights as plain Parameters."""

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        old = self._parameters.get(name)
        super().register_parameter(name, param)
        if old is not None and param is not None and param is not old and param.shape == old.shape:
            for key, value in vars(old).items():
                if not hasattr(param, key):
                    setattr(param, key, value)


def _shard_linear_(linear: nn.Linear, dim: int, shard_index: torch.Tensor) -> nn.Parameter:
    """Keep ``shard_index`` of ``linear.weight`` along ``dim`` (a new Parameter, same flags)."""
    full = linear.weight
    local = shard_from_full(full.detach(), dim, shard_index).contiguous()
    linear.weight = nn.Parameter(local, requires_grad=full.requires_grad)
    if dim == 0:
        linear.out_features = local.shape[0]
    else:
        linear.in_features = local.shape[1]
    return linear.weight


class LoraColumnParallelLinear(_ParallelLoraLinear):
    """LoRA on a ``ColumnParallelLinear``: A replicated, B sharded like the base rows."""

    def shard_adapter(self, adapter_name: str) -> None:
        base = self.get_base_layer()
        rows = base.weight.shard_index
        lora_b = _shard_linear_(self.lora_B[adapter_name], 0, rows)
        set_tensor_model_parallel_attributes(
            lora_b, partition_dim=0, logical_size=base.output_size, shard_index=rows, num_replicas=base.num_replicas
        )
        mark_partial_grad_over_tp(self.lora_A[adapter_name].weight)
        # kept on the module too: pipeline shape propagation swaps parameters for fake tensors
        self.b_shard_index, self.b_keep_rows = rows, local_rows_mask(rows)

    def _b_weight(self, base: ColumnParallelLinear, adapter_name: str) -> torch.Tensor:
        """B_i, its replicated rows' gradients summed and its padding rows' gradients zeroed."""
        weight = self.lora_B[adapter_name].weight
        if base._has_replicas:
            return mappings.SumReplicaGrads.apply(weight, self.b_shard_index, base.output_size)
        keep = self.b_keep_rows
        return weight if keep is None else weight * keep.to(weight.device, weight.dtype).unsqueeze(1)

    def forward_with_adapters(self, x: torch.Tensor, active: list[str]) -> torch.Tensor:
        base = self.base_layer
        x = base.input_to_region(x)  # [b, s, in]: replicated, so dropout draws one mask everywhere
        result = base.forward_local(x)  # [b, s, out/tp]
        # dropout draws in memory order: a sequence all-gather's output is not contiguous
        x_lora = x.contiguous()
        for name in active:
            lora_a = self.lora_A[name]
            h = lora_a(self.lora_dropout[name](self._cast_input_dtype(x_lora, lora_a.weight.dtype)))  # [b, s, r]
            result = result + F.linear(h, self._b_weight(base, name)).to(result.dtype) * self.scaling[name]
        return base.output_from_region(result)


class LoraRowParallelLinear(_ParallelLoraLinear):
    """LoRA on a ``RowParallelLinear``: A sharded like the base columns, B replicated."""

    def shard_adapter(self, adapter_name: str) -> None:
        base = self.get_base_layer()
        cols = base.weight.shard_index
        lora_a = _shard_linear_(self.lora_A[adapter_name], 1, cols)
        set_tensor_model_parallel_attributes(lora_a, partition_dim=1, logical_size=base.input_size, shard_index=cols)
        mark_partial_grad_over_tp(self.lora_B[adapter_name].weight)
        self.a_shard_index = cols  # see LoraColumnParallelLinear.shard_adapter

    def _local_dropout(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Dropout of ``X_i`` with this rank's columns of one mask drawn over the full input
        (the same draws on every rank, and as plain peft on the unsharded model)."""
        dropout = self.lora_dropout[name]
        if not isinstance(dropout, nn.Dropout) or not dropout.training or dropout.p == 0:
            return dropout(x)
        base = self.base_layer
        full_mask = dropout(x.new_ones((*x.shape[:-1], base.input_size)))  # [b, s, in]: 0 or 1/(1-p)
        return x * shard_from_full(full_mask, x.dim() - 1, self.a_shard_index)

    def forward_with_adapters(self, x: torch.Tensor, active: list[str]) -> torch.Tensor:
        base = self.base_layer
        x = base.local_input(x)  # [b, s, in/tp]
        result = F.linear(x, base.weight)  # [b, s, out], partial sum over TP
        for name in active:
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            h = lora_a(self._local_dropout(name, self._cast_input_dtype(x, lora_a.weight.dtype)))  # partial [b, s, r]
            result = result + lora_b(h).to(result.dtype) * self.scaling[name]
        return base.reduce_partial(result)


LORA_LAYERS = {ColumnParallelLinear: LoraColumnParallelLinear, RowParallelLinear: LoraRowParallelLinear}


class LoraPartialGradLinear(peft_lora.Linear):
    """peft's own LoRA on a replicated ``nn.Linear`` whose gradient is partial on each TP rank
    (marked ``partial_grad_over_tp``: multi-head latent attention's down-projections, which feed
    only this rank's heads; any replicated layer under SP): its adapters' gradients are partial
    alike and are summed over TP."""

    def update_layer(self, adapter_name: str, *args, **kwargs) -> None:
        super().update_layer(adapter_name, *args, **kwargs)
        if adapter_name in self.lora_A:
            mark_partial_grad_over_tp(self.lora_A[adapter_name].weight)
            mark_partial_grad_over_tp(self.lora_B[adapter_name].weight)
