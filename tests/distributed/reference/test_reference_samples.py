"""Every code sample of the reference documents in ``shared/reference/`` (beside the checkout) that names an API
nxd_hf provides runs as its own test, adapted only by the import (``neuronx_distributed`` ->
``nxd_hf``) and tiny sizes, compared with a one-process reference where it computes something
(all run in one world-2 spawn). The samples that
cannot run here are listed below with the reason and the nxd_hf code that runs instead."""

import copy
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers import ColumnParallelLinear, RowParallelLinear
from nxd_hf.parallel_layers.pad import gather_full_tensor
from nxd_hf.testing import run_distributed
from support import hf_parity, own_models
from support.reference_fixes import run_named


TOL = hf_parity.TOL


def _full(param):
    return gather_full_tensor(param) if getattr(param, "tensor_model_parallel", False) else param.detach()


def _full_grad(param):
    return gather_full_tensor(param, param.grad) if getattr(param, "tensor_model_parallel", False) else param.grad


def _reset():
    from nxd_hf import parallel_state

    parallel_state.destroy_model_parallel()


# -- nxd-core-api.rst ---------------------------------------------------------------------------
def core_parallel_state(tmp):
    import nxd_hf

    _reset()
    nxd_hf.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    ps = nxd_hf.parallel_state
    assert ps.get_data_parallel_size() == 1 and ps.get_tensor_model_parallel_size() == 2
    assert ps.get_tensor_model_parallel_rank() == backend.rank() and ps.get_pipeline_model_parallel_size() == 1
    assert ps.get_pipeline_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    assert ps.get_data_parallel_group(as_list=True) == [[0], [1]]
    assert ps.get_tensor_model_parallel_group(as_list=True) == [[0, 1]]
    assert ps.get_pipeline_model_parallel_group(as_list=True) == [[0], [1]]
    for getter in (ps.get_data_parallel_group, ps.get_tensor_model_parallel_group, ps.get_pipeline_model_parallel_group):
        assert not isinstance(getter(as_list=False), list)


def core_parallel_layers(tmp):
    """ParallelEmbedding, ColumnParallelLinear, RowParallelLinear (the documented signatures),
    against torch's layers on the gathered weights; move_model_to_device keeps the TP attributes."""
    import nxd_hf
    from nxd_hf.parallel_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, move_model_to_device

    _reset()
    nxd_hf.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    emb = ParallelEmbedding(11, 8, init_method=nn.init.normal_, dtype=torch.float32, device=None)
    col = ColumnParallelLinear(8, 6, bias=True, gather_output=True, sequence_parallel_enabled=False,
                               dtype=torch.float32, device=None)
    row = RowParallelLinear(6, 8, bias=True, input_is_parallel=False, sequence_parallel_enabled=False,
                            dtype=torch.float32, device=False)
    model = nn.ModuleList([emb, col, row])
    move_model_to_device(model, torch.device("cpu"))
    assert col.weight.tensor_model_parallel and row.weight.tensor_model_parallel
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    out = row(col(emb(ids)))
    ref = F.linear(F.linear(F.embedding(ids, _full(emb.weight)), _full(col.weight), _full(col.bias)),
                   _full(row.weight), row.bias.detach())
    torch.testing.assert_close(out, ref, **TOL)


def core_pad_model(tmp):
    """The pad_model usage: the divided head count with get_number_of_extra_heads, pad_model
    with and without wrapped_classes, and a pad_hook_fn, against the unpadded model."""
    import nxd_hf
    from nxd_hf.parallel_layers import ColumnParallelLinear, RowParallelLinear
    from nxd_hf.parallel_layers import utils as neuronx_dist_utils
    from nxd_hf.parallel_layers.pad import get_number_of_extra_heads, pad_model
    from nxd_hf.parallel_state import get_tensor_model_parallel_size

    class MyAttention(nn.Module):
        def __init__(self, num_heads=3, head_dim=4):
            super().__init__()
            self.num_heads, self.head_dim, self.split_size = num_heads, head_dim, num_heads * head_dim
            self.qkv = ColumnParallelLinear(12, 12, gather_output=False)
            self.out = RowParallelLinear(12, 12, input_is_parallel=True)
            self.num_heads = neuronx_dist_utils.divide(
                self.num_heads + get_number_of_extra_heads(self.num_heads, get_tensor_model_parallel_size()),
                get_tensor_model_parallel_size())

        def forward(self, x):
            h = self.qkv(x).unflatten(-1, (self.num_heads, self.head_dim)).softmax(-1).flatten(-2)
            return self.out(h)

    _reset()
    nxd_hf.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    x = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    reference = MyAttention()  # copy.deepcopy would drop the TP attributes of the parameters (torch's Parameter)
    with torch.no_grad():
        ref_out = F.linear(F.linear(x, _full(reference.qkv.weight), _full(reference.qkv.bias))
                           .unflatten(-1, (3, 4)).softmax(-1).flatten(-2), _full(reference.out.weight),
                           reference.out.bias)
    desired_config = SimpleNamespace(num_heads=3)
    for wrapped in ((), [MyAttention]):
        torch.manual_seed(0)
        model = MyAttention()

        def my_hook(attention_to_pad, tgt_src_ratio):
            # the doc's hook reads model.split_size; the attention it is given is what it means
            attention_to_pad.split_size = int(attention_to_pad.split_size * tgt_src_ratio)

        # the doc's `pad_model(model, tp_degree=32, desired_config.num_heads)` is a SyntaxError
        # (positional after keyword): n_heads by keyword; tp_degree 2 here
        model = pad_model(model, tp_degree=2, n_heads=desired_config.num_heads, wrapped_classes=wrapped,
                          pad_hook_fn=my_hook)
        assert model.split_size == 16, model.split_size
        torch.testing.assert_close(model(x), ref_out, **TOL)


def core_parallel_cross_entropy(tmp):
    import nxd_hf
    from nxd_hf.parallel_layers.loss_functions import parallel_cross_entropy

    _reset()
    nxd_hf.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    g = torch.Generator().manual_seed(3)
    logits, labels = torch.randn(2, 5, 10, generator=g), torch.randint(0, 10, (2, 5), generator=g)
    parallel_logits = logits.chunk(2, -1)[backend.rank()].clone().requires_grad_()
    loss = parallel_cross_entropy(parallel_logits, labels, label_smoothing=0.1)
    ref = F.cross_entropy(logits.view(-1, 10), labels.view(-1), reduction="none", label_smoothing=0.1).view(2, 5)
    torch.testing.assert_close(loss, ref, **TOL)


def _llama_reference(layers=4):
    _reset()
    return hf_parity.build_pair("llama", num_hidden_layers=layers)


def _pp_batch():
    ids, labels = hf_parity.batch(b=4)
    return ids, torch.ones_like(ids), labels


def core_nxdppmodel_signature(tmp):
    """NxDPPModel with every documented argument; run_train, run_eval, local_named_parameters,
    local_named_modules."""
    import nxd_hf
    from nxd_hf.pipeline import NxDPPModel

    reference, model = _llama_reference()
    nxd_hf.parallel_state.initialize_model_parallel(1, 2)
    model = NxDPPModel(model, transformer_layer_cls=transformers.models.llama.modeling_llama.LlamaDecoderLayer,
                       num_microbatches=2, virtual_pipeline_size=1, output_loss_value_spec=None,
                       return_mb_loss=False, broadcast_and_average_loss=True, pipeline_cuts=["model.layers.1"],
                       input_names=["input_ids", "attention_mask", "labels"], leaf_module_cls=None,
                       autowrap_functions=None, autowrap_modules=None, tracer_cls=None, param_init_fn=None,
                       trace_file_path=None, use_zero1_optimizer=False, auto_partition=False,
                       deallocate_pipeline_outputs=False)
    ids, mask, labels = _pp_batch()
    ref_loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    torch.testing.assert_close(model.run_train(input_ids=ids, attention_mask=mask, labels=labels), ref_loss.detach(), **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.local_named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, **TOL)
    assert any(name.endswith("layers.0") or name.endswith("layers.2") for name, _ in model.local_named_modules())
    torch.testing.assert_close(model.run_eval(input_ids=ids, attention_mask=mask, labels=labels), ref_loss.detach(), **TOL)


# -- nxd-pipeline-parallel-guide.rst ------------------------------------------------------------
def create_partition(config, args):
    """
    Evenly split the transformer layers between the PP ranks
    """
    assert config.num_hidden_layers % args.pipeline_parallel_size == 0
    num_layer_per_partition = config.num_hidden_layers // args.pipeline_parallel_size
    pipeline_cuts = []
    current_cut = num_layer_per_partition - 1
    for i in range(args.pipeline_parallel_size - 1):
        pipeline_cuts.append(f"model.layers.{current_cut}")
        current_cut += num_layer_per_partition
    if torch.distributed.get_rank() == 0:
        print(f"pipeline_cuts {pipeline_cuts}")
    return pipeline_cuts


def _pp_args(tmp, **kwargs):
    return SimpleNamespace(**{"pipeline_parallel_size": 2, "num_microbatches": 2, "use_zero1_optimizer": False,
                              "trace_file_path": os.path.join(tmp, f"trace{backend.rank()}.txt"), "use_amp": 0,
                              **kwargs})


def _guide_model(tmp, args, model_cls=transformers.LlamaForCausalLM):
    """The guide's "Creating Model" sample on a tiny Llama config."""
    from nxd_hf.parallel_layers import mappings
    from nxd_hf.pipeline import NxDPPModel
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    import nxd_hf

    _reset()
    nxd_hf.parallel_state.initialize_model_parallel(1, args.pipeline_parallel_size)
    config = transformers.LlamaConfig(**{**hf_parity.TINY["llama"][2], "num_hidden_layers": 4})
    # Create torch model
    # the guide sets config.return_dict = False here; transformers 5's LlamaForCausalLM then fails
    # on its own (its forward reads .last_hidden_state), with or without nxd_hf: left out
    torch.manual_seed(0)
    model = model_cls(config)
    reference = copy.deepcopy(model)
    # Create pipeline cuts
    pipeline_cuts = create_partition(config, args)
    # Apply model wrapper
    model = NxDPPModel(
        model,
        transformer_layer_cls=LlamaDecoderLayer,
        num_microbatches=args.num_microbatches,
        virtual_pipeline_size=1,
        output_loss_value_spec=(True, False),
        input_names=["input_ids", "attention_mask", "labels"],
        pipeline_cuts=pipeline_cuts,
        trace_file_path=args.trace_file_path,
        leaf_module_cls=[LlamaRMSNorm.__name__],
        autowrap_modules=[mappings],
        use_zero1_optimizer=args.use_zero1_optimizer,
        deallocate_pipeline_outputs=False,
        broadcast_and_average_loss=True,  # not in the sample: every rank gets the loss to compare
    )
    model.move_model_to_device()
    return reference, model


def _compare_step(reference, model, grads=True):
    ids, mask, labels = _pp_batch()
    ref_loss = reference(input_ids=ids, attention_mask=mask, labels=labels)[0]
    ref_loss.backward()
    loss = model.run_train(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    if grads:
        ref_params = dict(reference.named_parameters())
        for name, param in model.local_named_parameters():
            torch.testing.assert_close(param.grad, ref_params[name].grad, **TOL, msg=lambda m: f"{name}: {m}")


def pp_guide_creating_model(tmp):
    args = _pp_args(tmp)
    reference, model = _guide_model(tmp, args)
    assert model.pipeline_cuts == ["model.layers.1"]
    assert os.path.getsize(args.trace_file_path) > 0
    _compare_step(reference, model)


def pp_guide_mixed_precision(tmp):
    args = _pp_args(tmp, use_amp=1)
    reference, model = _guide_model(tmp, args)
    input_ids, attention_mask, labels = _pp_batch()
    # device_type="cuda" in the guide; this is a CPU run
    with torch.autocast(enabled=args.use_amp > 0, dtype=torch.bfloat16, device_type="cpu"):
        loss = model.run_train(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
        )
        ref_loss = reference(input_ids=input_ids, attention_mask=attention_mask, labels=labels)[0]
    # bf16 autocast: the microbatched pipeline rounds differently from the one-process run
    torch.testing.assert_close(loss, ref_loss.detach().float(), rtol=2e-2, atol=2e-2)


def pp_guide_meta_device_init(tmp):
    """init_on_device(meta) + the guide's init_weights as param_init_fn (GPT-2: the Conv1D,
    Embedding and LayerNorm branches of the sample all run)."""
    import nxd_hf
    from nxd_hf.pipeline import NxDPPModel
    from nxd_hf.utils.model_utils import init_on_device
    from transformers.pytorch_utils import Conv1D

    _reset()
    nxd_hf.parallel_state.initialize_model_parallel(1, 2)
    model_config = transformers.GPT2Config(**{**hf_parity.TINY["gpt2"][2], "n_layer": 4})
    with init_on_device(torch.device("meta")):
        model = transformers.GPT2LMHeadModel(model_config)

    def init_weights(module):
        from nxd_hf.parallel_layers import ColumnParallelLinear, RowParallelLinear, ParallelEmbedding
        if isinstance(module, (nn.Linear, Conv1D)):
            module.weight.data.normal_(mean=0.0, std=model_config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=model_config.initializer_range)
            if module.padding_idx:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)
        elif isinstance(module, (ParallelEmbedding, RowParallelLinear, ColumnParallelLinear)):
            module.init_weight_cpu()
            if hasattr(module, "bias") and module.bias is not None:
                module.bias.data.zero_()

    model = NxDPPModel(model, num_microbatches=2, param_init_fn=init_weights, broadcast_and_average_loss=True)
    local = dict(model.local_named_parameters())
    assert local and not any(p.is_meta for p in local.values())
    for name, p in local.items():
        if name.endswith("ln_1.weight") or name.endswith("ln_f.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("c_attn.weight"):
            assert abs(p.std().item() - model_config.initializer_range) < 0.005, (name, p.std())
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
    ids, labels = hf_parity.batch(b=4)
    assert torch.isfinite(model.run_train(input_ids=ids, labels=labels))


def pp_guide_apply_checkpoint(tmp):
    """The guide's CheckPointWrapper and apply_checkpoint, unchanged but for torch_xla's
    checkpoint (torch's here); training equals the model without checkpointing."""
    from typing import Any, Dict, Iterator, Tuple
    import torch.nn as nn

    import torch
    from torch.utils.checkpoint import checkpoint as torch_checkpoint  # torch_xla.utils.checkpoint in the guide
    from nxd_hf.parallel_layers.parallel_state import rmsg
    from nxd_hf.utils.logger import get_logger
    from torch.distributed.utils import _replace_by_prefix

    logger = get_logger()

    _CHECKPOINT_WRAPPED_MODULE = "mod"
    _CHECKPOINT_PREFIX = _CHECKPOINT_WRAPPED_MODULE + "."

    class CheckPointWrapper(torch.nn.Module):
        def __init__(self, mod) -> None:
            super().__init__()
            self.mod = mod
            # state_dict post hook to remove prefix to allow loading into a
            # non-checkpoint wrapped module.
            self._register_state_dict_hook(self._post_state_dict_hook)
            # load_state_dict pre-hook to allow loading back into
            # checkpoint-wrapped module.
            self._register_load_state_dict_pre_hook(
                self._pre_load_state_dict_hook, with_module=True
            )

        def forward(self, *args, **kwargs):
            ordered_args = list(args)
            for value in kwargs.values():
                ordered_args += [value]

            # Note: checkpoint cannot accept kwargs
            return torch_checkpoint(self.mod, *ordered_args, use_reentrant=True)

        def named_parameters(
            self,
            *args,
            **kwargs,
        ) -> Iterator[Tuple[str, torch.nn.Parameter]]:
            for param_name, param in super().named_parameters(*args, **kwargs):
                updated_name = param_name.replace(_CHECKPOINT_PREFIX, "")
                yield updated_name, param

        def named_modules(self, *args, **kwargs):
            for module_name, module in super().named_modules(*args, **kwargs):
                updated_name = module_name.replace(_CHECKPOINT_PREFIX, "")
                yield updated_name, module

        @staticmethod
        def _post_state_dict_hook(
            module: nn.Module,
            state_dict: Dict[str, Any],
            prefix: str,
            *args: Any,
        ) -> Dict[str, Any]:
            _replace_by_prefix(state_dict, f"{prefix}{_CHECKPOINT_PREFIX}", prefix)
            return state_dict

        @staticmethod
        def _pre_load_state_dict_hook(
            module: nn.Module,
            state_dict: Dict[str, Any],
            prefix: str,
            *args: Any,
        ) -> None:
            _replace_by_prefix(state_dict, prefix, prefix + f"{_CHECKPOINT_PREFIX}")

    wrapped = []

    def apply_checkpoint(dist_model, layers_to_checkpoint=None):
        checkpoint_wrapper_added = False
        if layers_to_checkpoint is not None and len(layers_to_checkpoint) == 0:
            raise RuntimeError(
                rmsg(f"invalid input layers_to_checkpoint {layers_to_checkpoint}, can't be empty")
            )
        for name, module in dist_model.local_module.named_children():
            # checkpoint layers that are provided in input
            # if layers not provide in input, then checkpoint if it is transformer layer
            if (layers_to_checkpoint and name in layers_to_checkpoint) or (
                not layers_to_checkpoint and type(module) == dist_model.transformer_layer_cls
            ):
                # add_module replaces old module with our own custom module.
                # https://pytorch.org/docs/stable/_modules/torch/nn/modules/module.html#Module.add_module
                dist_model.local_module.add_module(name, CheckPointWrapper(module))
                checkpoint_wrapper_added = True
                wrapped.append(name)
        if layers_to_checkpoint is not None and not checkpoint_wrapper_added:
            logger.warning(
                rmsg(f"layers_to_checkpoint {layers_to_checkpoint} do not exist in the graph")
            )
        elif layers_to_checkpoint is None and not checkpoint_wrapper_added:
            logger.warning(
                rmsg(
                    f"During applying activation checkpointing, transformer_layer_cls {dist_model.transformer_layer_cls.__name__} can not be found in stage {dist_model.pipeline_parallel_rank}, skipping..."
                )
            )

    args = _pp_args(tmp)
    reference, model = _guide_model(tmp, args)
    # Will checkpoint every transformer layer
    apply_checkpoint(model)
    assert len(wrapped) == 2, f"rank {backend.rank()} wrapped {wrapped}"
    _compare_step(reference, model)


def pp_guide_hf_class_name(tmp):
    from transformers.models.llama.modeling_llama import LlamaForCausalLM as LlamaForCausalLMHF

    # Keep the same class name as original one
    class LlamaForCausalLM(LlamaForCausalLMHF):
        ...

    reference, model = _guide_model(tmp, _pp_args(tmp), model_cls=LlamaForCausalLM)
    _compare_step(reference, model)


def pp_guide_auto_partition_and_interleaving(tmp):
    import nxd_hf
    from nxd_hf.pipeline import NxDPPModel

    for virtual_pipeline_size in (1, 2):  # interleaved: virtual_pipeline_size * pp = the number of layers
        reference, model = _llama_reference()
        nxd_hf.parallel_state.initialize_model_parallel(1, 2)
        model = NxDPPModel(model, transformer_layer_cls=transformers.models.llama.modeling_llama.LlamaDecoderLayer,
                           num_microbatches=2, virtual_pipeline_size=virtual_pipeline_size, auto_partition=True,
                           broadcast_and_average_loss=True)
        expected = ["model.layers.1"] if virtual_pipeline_size == 1 else ["model.layers.0", "model.layers.1",
                                                                           "model.layers.2"]
        assert model.pipeline_cuts == expected, model.pipeline_cuts
        _compare_step(reference, model, grads=False)


# -- nxd-tensor-parallel-guide.rst --------------------------------------------------------------
def tp_guide_dataloader(tmp):
    import nxd_hf
    from nxd_hf.parallel_layers import parallel_state
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    def pretraining_dataset(input_file, max_pred_length):  # the user's dataset class in the guide
        return TensorDataset(torch.arange(16).view(8, 2))

    def create_pretraining_dataset(input_file, max_pred_length, mini_batch_size, worker_init):
        train_data = pretraining_dataset(input_file=input_file, max_pred_length=max_pred_length)
        train_sampler = DistributedSampler(
            train_data,
            num_replicas=parallel_state.get_data_parallel_world_size(),
            rank=parallel_state.get_data_parallel_rank(),
        )
        train_dataloader = DataLoader(
            train_data,
            sampler=train_sampler,
            batch_size=mini_batch_size,
            num_workers=0,
            worker_init_fn=worker_init,
            drop_last=True,
            pin_memory=False,  # True in the guide; no accelerator here
        )
        return train_dataloader

    _reset()
    nxd_hf.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    batches = [b[0] for b in create_pretraining_dataset(None, 2, 4, None)]
    everyone = backend.all_gather_object([b.tolist() for b in batches])
    assert everyone[0] == everyone[1], "TP ranks of one DP rank get the same data"


def _bert_pair():
    _reset()
    return hf_parity.build_pair("bert", task_model_cls=transformers.BertModel)


def _load_full(module_from, module_to):
    """Copy ``module_from``'s weights into ``module_to`` (whose parallel layers take their shard)."""
    from nxd_hf.parallel_layers.sharding import shard_from_full

    params = dict(module_to.named_parameters())
    with torch.no_grad():
        for name, full in module_from.named_parameters():
            p = params[name]
            p.copy_(shard_from_full(full, p.partition_dim, p.shard_index) if getattr(p, "tensor_model_parallel", False)
                    else full)


# The guide's model: BERT's attention with parallel layers (module level: the config-API case builds it too)
class ParallelSelfAttention(transformers.models.bert.modeling_bert.BertSelfAttention):
    def __init__(self, config, position_embedding_type=None):
        # the guide passes position_embedding_type on; transformers 5's second argument is is_causal
        super().__init__(config)

        self.query = ColumnParallelLinear(config.hidden_size,
                                          self.all_head_size,
                                          gather_output=False)
        self.key = ColumnParallelLinear(config.hidden_size,
                                        self.all_head_size,
                                        gather_output=False)
        self.value = ColumnParallelLinear(config.hidden_size,
                                          self.all_head_size,
                                          gather_output=False)
        # Since we shard the number of attention heads across tensor parallel
        # ranks, each rank would have a subset of heads, hence, we update
        # the num_attention_heads here.
        tp_size = parallel_state.get_tensor_parallel_size()
        self.num_attention_heads = self.num_attention_heads // tp_size
        self.all_head_size = self.all_head_size // tp_size


class ParallelSelfOutput(transformers.models.bert.modeling_bert.BertSelfOutput):
    def __init__(self, config):
        super().__init__(config)
        self.dense = RowParallelLinear(config.hidden_size,
                                       config.hidden_size,
                                       input_is_parallel=True)


def _guide_bert(model):
    """``model`` with the guide's two modules in every layer (as its "Creating Model" does)."""
    for layer in model.encoder.layer:
        layer.attention.self = ParallelSelfAttention(model.config)
        layer.attention.output = ParallelSelfOutput(model.config)
    return model


def tp_guide_bert_and_training_script(tmp):
    """The guide's ParallelSelfAttention / ParallelSelfOutput swapped into BERT, and its training
    loop (clip_grad_norm from parallel_layers), against the unmodified BERT."""
    import nxd_hf
    from nxd_hf import parallel_layers
    from nxd_hf.parallel_layers import clip_grad_norm

    reference, model = _bert_pair()
    nxd_hf.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    _guide_bert(model)
    _load_full(reference, model)
    device = torch.device("cpu")
    parallel_layers.move_model_to_device(model, device)
    max_norm = 0.5
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    g = torch.Generator().manual_seed(5)
    dataloader = [((torch.randint(0, hf_parity.VOCAB, (2, 6), generator=g),), torch.randn(2, 6, 48, generator=g))
                  for _ in range(3)]

    def loss_fn(output, labels):
        return F.mse_loss(output.last_hidden_state, labels)

    for inputs, labels in dataloader:
        output = model(*inputs)
        loss = loss_fn(output, labels)
        loss.backward()
        # Here we use clip_grad_norm from nxd_hf as that
        # can handle tensor parallel ranks
        clip_grad_norm(model.parameters(), max_norm)
        # xm.optimizer_step(optimizer, groups=parallel_state.get_data_parallel_group(as_list=True)) in the
        # guide (XLA only): the DP group has one rank here, so the step is the plain one
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        ref_loss = loss_fn(reference(*inputs), labels)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        for group in ref_optimizer.param_groups:
            group["lr"] *= 0.1  # StepLR(step_size=1, gamma=0.1)
        torch.testing.assert_close(loss, ref_loss, **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(_full(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")
    # Saving Model (the guide's parallel_layers.save call; deprecated: save_checkpoint)
    PATH, epoch = os.path.join(tmp, "tp_guide"), 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        nxd_hf.parallel_layers.save({
            'epoch': epoch,
            'model': model.state_dict(),
            'optimizer_state_dict': optimizer.state_dict(),
            'loss': loss,
        }, PATH)
        _, fresh = _bert_pair()
        nxd_hf.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        _guide_bert(fresh)
        assert nxd_hf.parallel_layers.load(PATH, fresh)["epoch"] == epoch
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def _guide_model_fn():
    """The guide's model as a config-API ``model_fn``: built after neuronx_distributed_config (its
    layers read the TP size), holding the reference BERT's weights."""
    reference, model = hf_parity.build_pair("bert", task_model_cls=transformers.BertModel)
    _load_full(reference, _guide_bert(model))
    return model


def tp_guide_model_through_config_api(tmp):
    """The guide's model built by initialize_parallel_model's model_fn (used as built: no second
    sharding) and the guide's loop (forward, loss_fn, backward, the config API's optimizer) at tp=2,
    saved with save_checkpoint and trained on at dp=2 + ZeRO-1: equal to the unmodified BERT."""
    import nxd_hf as nxd

    reference = _bert_pair()[0]
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    dataloader = [((torch.randint(0, hf_parity.VOCAB, (4, 6), generator=g),), torch.randn(4, 6, 48, generator=g))
                  for _ in range(4)]

    def loss_fn(output, labels):
        return F.mse_loss(output.last_hidden_state, labels)

    for tp, zero1, steps in ((2, False, dataloader[:2]), (1, True, dataloader[2:])):
        _reset()
        nxd_config = nxd.neuronx_distributed_config(tensor_parallel_size=tp, optimizer_config={"zero_one_enabled": zero1})
        model = nxd.initialize_parallel_model(nxd_config, _guide_model_fn)
        assert model.nxd.patch is None and isinstance(model.local_module().encoder.layer[0].attention.self,
                                                      ParallelSelfAttention)
        optimizer = nxd.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), lr=1e-3)
        if zero1:
            nxd.load_checkpoint(os.path.join(tmp, "tp_guide_ckpt"), model=model, optimizer=optimizer)
        dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
        for inputs, labels in steps:
            output = model(*(x.chunk(dp_size)[dp_rank] for x in inputs))
            loss = loss_fn(output, labels.chunk(dp_size)[dp_rank])
            loss.backward()
            optimizer.step()  # the DP mean of the gradients, clipping at 1.0, the step
            optimizer.zero_grad()
            ref_loss = loss_fn(reference(*inputs), labels)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            loss = loss.detach() / dp_size  # the batch's loss: the mean of the DP ranks' halves
            backend.all_reduce(loss, parallel_state.get_data_parallel_group())
            torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        if not zero1:
            nxd.save_checkpoint(os.path.join(tmp, "tp_guide_ckpt"), model=model, optimizer=optimizer, nxd_config=nxd_config)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(_full(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


class _GuideBertLoss(nn.Module):
    """The guide's model with its loss_fn inside: NxDPPModel runs a forward that returns the loss."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, labels, attention_mask=None):
        return F.mse_loss(self.bert(input_ids, attention_mask=attention_mask).last_hidden_state, labels)


def tp_guide_model_at_pp2(tmp):
    """The guide's model (its loss_fn in a wrapper) at pp=2 through the config API, without an
    attention_mask: BERT's mask builder returns None, which crosses the stage boundary (it used
    to fail: "... (NoneType, not a tensor) crosses a pipeline stage boundary").
    Losses, first-step gradients and weights after AdamW steps equal the unmodified BERT's."""
    import nxd_hf as nxd

    reference = _GuideBertLoss(_bert_pair()[0])
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    _reset()
    nxd_config = nxd.neuronx_distributed_config(pipeline_parallel_size=2, pipeline_config={
        "num_microbatches": 2, "transformer_layer_cls": transformers.models.bert.modeling_bert.BertLayer,
        "input_names": ["input_ids", "labels"]})
    with warnings.catch_warnings():  # the trace's example labels are token ids: mse_loss warns on their shape
        warnings.simplefilter("ignore", UserWarning)
        model = nxd.initialize_parallel_model(nxd_config, lambda: _GuideBertLoss(_guide_model_fn()))
    optimizer = nxd.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        ids, labels = torch.randint(0, hf_parity.VOCAB, (4, 6), generator=g), torch.randn(4, 6, 48, generator=g)
        loss = model.run_train(input_ids=ids, labels=labels)
        ref_loss = reference(ids, labels)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        if step == 0:
            ref_grads = dict(reference.named_parameters())
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.grad, ref_grads[name].grad, **TOL, msg=lambda m: f"grad {name}: {m}")
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # the config API's default max_grad_norm
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


# -- nxd-training-api.txt -----------------------------------------------------------------------
def _get_model():
    return hf_parity.build_pair("llama", num_hidden_layers=4)[1]


def api_config_model_optimizer(tmp):
    """neuronx_distributed_config with every documented argument, initialize_parallel_model and
    NxDModel's methods, initialize_parallel_optimizer: AdamW steps with the default clipping
    (max_grad_norm 1.0) equal plain AdamW with clip_grad_norm_."""
    import nxd_hf
    from nxd_hf.trainer import initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config

    _reset()
    nxd_config = neuronx_distributed_config(
        tensor_parallel_size=2, pipeline_parallel_size=1, pipeline_config=None, optimizer_config=None,
        activation_checkpoint_config="full", pad_model=False, sequence_parallel=True, model_init_config=None,
        lora_config=None)
    model = initialize_parallel_model(nxd_config, _get_model)
    assert model.local_module() is not None and model.config.model_type == "llama" and model.dtype == torch.float32
    optimizer = initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), lr=1e-2)
    reference = hf_parity.build_pair("llama", num_hidden_layers=4)[0]
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)  # losses only: robust to Adam's rounding
    for step in range(2):
        ids, labels = hf_parity.batch(seed=step)
        loss = model.run_train(input_ids=ids, labels=labels)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = reference(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert nxd_hf.parallel_state.get_tensor_model_parallel_size() == 2


def api_lora(tmp):
    """The LoraConfig sample through the config API; save_checkpoint of the adapter only
    (save_lora_base=False), and load_lora_from_ckpt reading it back."""
    import nxd_hf
    import nxd_hf as neuronx_distributed
    import nxd_hf as nxd
    from nxd_hf.modules.lora import LoraConfig

    _reset()
    lora_config = neuronx_distributed.modules.lora.LoraConfig(
        enable_lora=True,
        lora_rank=16,
        lora_alpha=32,
        lora_dropout=0.05,
        bias="none",
        target_modules=["q_proj", "v_proj", "k_proj"],
        lora_verbose=False,  # not in the sample: keeps the test output quiet
        save_lora_base=False,
        merge_lora=False,
        save_lora_config_adapter=True,
    )
    nxd_config = neuronx_distributed.neuronx_distributed_config(tensor_parallel_size=2, lora_config=lora_config)
    model = neuronx_distributed.initialize_parallel_model(nxd_config, _get_model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable
    ids, labels = hf_parity.batch()
    model.run_train(input_ids=ids, labels=labels)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.01)
    checkpoint_dir, tag = os.path.join(tmp, "lora"), "step1"
    nxd.save_checkpoint(checkpoint_dir, tag, model=model, nxd_config=nxd_config)
    saved = {n: _full(p).clone() for n, p in model.named_parameters() if p.requires_grad}
    _reset()
    lora_config = LoraConfig(
        enable_lora=True,
        load_lora_from_ckpt=True,
        lora_save_dir=checkpoint_dir,  # checkpoint path
        lora_load_tag=tag,  # sub-directory under checkpoint path
        lora_verbose=False,
    )
    nxd_config = nxd.neuronx_distributed_config(tensor_parallel_size=2, lora_config=lora_config)
    model = nxd.initialize_parallel_model(nxd_config, _get_model)
    loaded = {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}
    assert loaded.keys() == saved.keys()
    for n in saved:
        torch.testing.assert_close(loaded[n], saved[n], **TOL)


def api_sample_usage(tmp):
    """The "Sample usage" section (tensor_parallel_size 8 -> 1: DP 2, so ZeRO-1 shards), with
    a scheduler; losses against AdamW with clip_grad_norm_ on the DP-mean gradient; then the
    checkpoint round trip."""
    import nxd_hf as nxd
    from torch.optim import AdamW

    get_model = _get_model
    _reset()
    # create config
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=1,
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
    )
    # wrap model
    model = nxd.initialize_parallel_model(nxd_config, get_model)
    # wrap optimizer
    optimizer = nxd.initialize_parallel_optimizer(nxd_config, AdamW, model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    reference = hf_parity.build_pair("llama", num_hidden_layers=4)[0]
    ref_optimizer = AdamW(reference.parameters(), lr=1e-3)
    total_steps = 0
    for step in range(2):  # (training loop)
        ids, labels = hf_parity.batch(seed=step, b=4)
        mine = slice(2 * backend.rank(), 2 * backend.rank() + 2)
        inputs = {"input_ids": ids[mine], "labels": labels[mine]}
        loss = model.run_train(inputs)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        total_steps += 1
        ref_loss = reference(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)  # the step's loss, on every rank
    # saving checkpoint
    nxd.save_checkpoint(
        os.path.join(tmp, "ckpts"),
        nxd_config=nxd_config,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        user_content={"total_steps": total_steps},
    )
    # loading checkpoint (auto-resume)
    user_content = nxd.load_checkpoint(
        os.path.join(tmp, "ckpts"),
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    assert user_content == {"total_steps": 2}, user_content


def api_sample_usage_own_model(tmp):
    """The "Sample usage" section with get_model returning a model written with nxd_hf's parallel
    layers (ParallelEmbedding, Column/RowParallelLinear, parallel_cross_entropy; tensor_parallel_size
    8 -> 2): used as built, losses against one process, then the checkpoint round trip."""
    import nxd_hf as nxd
    from torch.optim import AdamW

    def get_model():
        return own_models.build(parallel=True)

    _reset()
    # create config
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=2,
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
    )
    # wrap model
    model = nxd.initialize_parallel_model(nxd_config, get_model)
    # wrap optimizer
    optimizer = nxd.initialize_parallel_optimizer(nxd_config, AdamW, model.parameters(), lr=1e-3)
    reference = own_models.reference()
    ref_optimizer = AdamW(reference.parameters(), lr=1e-3)
    for step in range(2):  # (training loop)
        ids, labels = own_models.batch(step)
        inputs = {"input_ids": ids, "labels": labels}
        loss = model.run_train(inputs)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = reference(ids, labels)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    # saving checkpoint
    nxd.save_checkpoint(os.path.join(tmp, "own_ckpts"), nxd_config=nxd_config, model=model, optimizer=optimizer,
                        user_content={"total_steps": 2})
    # loading checkpoint (auto-resume), into a model built again
    model = nxd.initialize_parallel_model(nxd_config, get_model)
    optimizer = nxd.initialize_parallel_optimizer(nxd_config, AdamW, model.parameters(), lr=1e-3)
    assert nxd.load_checkpoint(os.path.join(tmp, "own_ckpts"), model=model, optimizer=optimizer) == {"total_steps": 2}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(_full(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


def api_gqa_qkv_linear(tmp):
    """GQAQKVColumnParallelLinear with the documented signature (NxD's layout: no head_dim)."""
    import nxd_hf
    from nxd_hf.modules.qkv_linear import GQAQKVColumnParallelLinear

    _reset()
    nxd_hf.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    for fuse_qkv in (True, False):
        layer = GQAQKVColumnParallelLinear(16, [32, 8], bias=True, gather_output=True, sequence_parallel_enabled=False,
                                           dtype=torch.float32, device=None, kv_size_multiplier=2, fuse_qkv=fuse_qkv)
        parts = [("qkv",)] if fuse_qkv else [("q",), ("k",), ("v",)]
        weight = torch.cat([_full(getattr(layer, f"weight_{p[0]}")) for p in parts])
        bias = torch.cat([_full(getattr(layer, f"bias_{p[0]}")) for p in parts])
        x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(torch.cat(layer(x), -1), F.linear(x, weight, bias), **TOL)


def api_clip_grad_norm(tmp):
    import nxd_hf
    from nxd_hf.parallel_layers import ColumnParallelLinear, RowParallelLinear, clip_grad_norm

    _reset()
    nxd_hf.parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(ColumnParallelLinear(6, 8, gather_output=False), RowParallelLinear(8, 6, input_is_parallel=True))
    reference = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 6))
    with torch.no_grad():
        for p, r in zip(model.parameters(), reference.parameters()):
            r.copy_(_full(p))
    x = torch.randn(3, 2, 6, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for norm_type in (2, float("inf")):
        norm = clip_grad_norm(model.parameters(), max_norm=0.5, norm_type=norm_type)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5, norm_type=norm_type)
        torch.testing.assert_close(torch.as_tensor(norm), ref_norm, **TOL)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(_full_grad(p), r.grad, **TOL)


def api_zero1_optimizer(tmp):
    """The NeuronZero1Optimizer sample (no_decay groups, pin_layout, sharding/grad-norm groups)
    at DP 2: torch-xla's default clipping at 1.0 included, against AdamW + clip_grad_norm_."""
    import nxd_hf
    from nxd_hf import parallel_state
    from nxd_hf.optim.zero1 import NeuronZero1Optimizer
    from torch.optim import AdamW

    _reset()
    nxd_hf.parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    flags = SimpleNamespace(lr=0.05)
    no_decay = ["bias", "1.weight"]

    def grouped(module):
        param_optimizer = list(module.named_parameters())
        return [
            {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
            {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
        ]

    optimizer_grouped_parameters = grouped(model)
    optimizer = NeuronZero1Optimizer(
        optimizer_grouped_parameters,
        AdamW,
        lr=flags.lr,
        pin_layout=False,
        sharding_groups=parallel_state.get_data_parallel_group(as_list=True),
        grad_norm_groups=parallel_state.get_tensor_model_parallel_group(as_list=True),
    )
    # gradients of 10 * x**2 on this small MLP are O(0.1-10), ~1e7 times eps: Adam's step does not
    # amplify their rounding, so the parameters compare at TOL on any CPU
    ref_optimizer = AdamW(grouped(reference), lr=flags.lr)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        (10 * model(x.chunk(2)[backend.rank()]).square().sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        (10 * sum(reference(half).square().sum() for half in x.chunk(2)) / 2).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, **TOL)
    # save_sharded_state_dict / load_sharded_state_dict (deprecated in NxD for save_checkpoint)
    optimizer.save_sharded_state_dict(os.path.join(tmp, "zero1"), save_serially=True)
    state = copy.deepcopy(optimizer.state_dict())
    optimizer.load_sharded_state_dict(os.path.join(tmp, "zero1"), num_workers_per_step=8)
    assert optimizer.state_dict().keys() == state.keys()


SAMPLES = [core_parallel_state, core_parallel_layers, core_pad_model, core_parallel_cross_entropy,
           core_nxdppmodel_signature, pp_guide_creating_model, pp_guide_mixed_precision, pp_guide_meta_device_init,
           pp_guide_apply_checkpoint, pp_guide_hf_class_name, pp_guide_auto_partition_and_interleaving,
           tp_guide_dataloader, tp_guide_bert_and_training_script, tp_guide_model_through_config_api,
           tp_guide_model_at_pp2,
           api_config_model_optimizer, api_lora, api_sample_usage, api_sample_usage_own_model, api_gqa_qkv_linear, api_clip_grad_norm, api_zero1_optimizer]


def run_samples(tmp: str, names: list[str]) -> dict:
    return run_named(SAMPLES, tmp, names)


# (document, sample) -> the case above that runs it
RUNS = {
    ("nxd-core-api.rst", "parallel_state: initialize_model_parallel and the helper APIs"): "core_parallel_state",
    ("nxd-core-api.rst", "ParallelEmbedding / ColumnParallelLinear / RowParallelLinear, move_model_to_device"):
        "core_parallel_layers",
    ("nxd-core-api.rst", "pad_model usage: divide(num_heads + get_number_of_extra_heads), wrapped_classes, "
                         "pad_hook_fn"): "core_pad_model",
    ("nxd-core-api.rst", "parallel_cross_entropy(parallel_logits, labels, label_smoothing)"):
        "core_parallel_cross_entropy",
    ("nxd-core-api.rst", "NxDPPModel(...) with every argument; run_train, run_eval, local_named_parameters, "
                         "local_named_modules"): "core_nxdppmodel_signature",
    ("nxd-pipeline-parallel-guide.rst", "Creating Model + create_partition + move_model_to_device"):
        "pp_guide_creating_model",
    ("nxd-pipeline-parallel-guide.rst", "Mixed precision: torch.autocast around run_train"):
        "pp_guide_mixed_precision",
    ("nxd-pipeline-parallel-guide.rst", "init_on_device(meta) + init_weights as param_init_fn"):
        "pp_guide_meta_device_init",
    ("nxd-pipeline-parallel-guide.rst", "Gradient checkpointing: CheckPointWrapper + apply_checkpoint"):
        "pp_guide_apply_checkpoint",
    ("nxd-pipeline-parallel-guide.rst", "HF models: a subclass keeping the HF class name"): "pp_guide_hf_class_name",
    ("nxd-pipeline-parallel-guide.rst", "Auto partition; interleaved virtual_pipeline_size"):
        "pp_guide_auto_partition_and_interleaving",
    ("nxd-tensor-parallel-guide.rst", "Creating DataLoader: DistributedSampler over the DP ranks"):
        "tp_guide_dataloader",
    ("nxd-tensor-parallel-guide.rst", "ParallelSelfAttention / ParallelSelfOutput (BERT), the final training "
                                      "script with clip_grad_norm, Saving Model with parallel_layers.save"):
        "tp_guide_bert_and_training_script",
    ("nxd-tensor-parallel-guide.rst", "The guide's model (ParallelSelfAttention / ParallelSelfOutput) as the config "
                                      "API's model_fn, at tp=2 and dp=2 + ZeRO-1, save/load_checkpoint across them"):
        "tp_guide_model_through_config_api",
    ("nxd-tensor-parallel-guide.rst", "The guide's model (its loss_fn in a wrapper) at pipeline_parallel_size=2 "
                                      "through the config API, no attention_mask (a None crosses the stage boundary)"):
        "tp_guide_model_at_pp2",
    ("nxd-training-api.txt", "neuronx_distributed_config / initialize_parallel_model (NxDModel methods) / "
                             "initialize_parallel_optimizer"): "api_config_model_optimizer",
    ("nxd-training-api.txt", "LoraConfig; LoRA save (adapter only) and load_lora_from_ckpt"): "api_lora",
    ("nxd-training-api.txt", "Sample usage: config, model, optimizer, run_train(inputs), save/load_checkpoint"):
        "api_sample_usage",
    ("nxd-training-api.txt", "Sample usage with get_model returning a model built from parallel layers "
                             "(tp=2, ZeRO-1)"): "api_sample_usage_own_model",
    ("nxd-training-api.txt", "GQAQKVColumnParallelLinear(input_size, output_sizes, ..., kv_size_multiplier, "
                             "fuse_qkv)"): "api_gqa_qkv_linear",
    ("nxd-training-api.txt", "clip_grad_norm(parameters, max_norm, norm_type)"): "api_clip_grad_norm",
    ("nxd-training-api.txt", "NeuronZero1Optimizer sample; save_sharded_state_dict / load_sharded_state_dict"):
        "api_zero1_optimizer",
}
"""``LoRAModel(module, LoraConfig)`` and ``parallel_layers.load`` run in ``test_reference_fixes.py``
(``case_lora_model``, ``case_parallel_layers_save_load``)."""

CANNOT_RUN = {
    ("nxd-tensor-parallel-guide.rst", "xm.optimizer_step(optimizer, groups=get_data_parallel_group(as_list=True))"):
        ("torch-xla only (XLA's step with a gradient all-reduce)",
         "optimizer.step() after the model's own DP gradient mean (nxd_hf.parallelize) or "
         "initialize_parallel_optimizer's step; runs in tp_guide_bert_and_training_script"),
    ("nxd-pipeline-parallel-guide.rst", "from torch_xla.utils.checkpoint import checkpoint"):
        ("torch-xla only", "torch.utils.checkpoint.checkpoint (pp_guide_apply_checkpoint), or "
                           "activation_checkpoint_config='full'"),
    ("nxd-pipeline-parallel-guide.rst", "torchdistx deferred_init.deferred_init(LlamaForCausalLM, config)"):
        ("torchdistx is unmaintained and does not build for torch 2.x; a model it built is refused with a "
         "ValueError (test_reference_fixes.py::test_torchdistx_deferred_init_is_refused)",
         "init_on_device(torch.device('meta')) + param_init_fn (pp_guide_meta_device_init)"),
    ("nxd-training-api.txt", "neuronx_distributed.lightning: NeuronLTModule, NeuronXLAStrategy, "
                             "NeuronXLAPrecisionPlugin, NeuronTQDMProgressBar, NeuronTensorBoardLogger"):
        ("PyTorch-Lightning on XLA; not provided by nxd_hf",
         "nxd_hf.NxDTrainer / NxDTrainingArguments (transformers.Trainer) for a managed training loop"),
    ("nxd-training-api.txt", "save(..., save_xser=True) / load(..., load_xser=True), use_xser, async_save"):
        ("torch-xla serialization", "accepted and ignored with a warning: nxd_hf writes safetensors"),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("samples"))
    return run_distributed(run_samples, 2, tmp, sorted(set(RUNS.values())), timeout_s=600)


def test_every_sample_case_is_listed():
    assert {s.__name__ for s in SAMPLES} == set(RUNS.values())


@pytest.mark.parametrize("sample", sorted(set(RUNS.values())))
def test_sample(world2, sample):
    for rank, results in enumerate(world2):
        assert results[sample] is None, f"rank {rank}:\n{results[sample]}"
