"""``NxDPPModel``: NxD's pipeline-parallel wrapper on torch.distributed.pipelining.

Construction: trace (``nxd_hf.pipeline.trace``), cut between transformer layers
(``partition``), split into stage modules (``stages``), keep this rank's stages only, then run
the local setup steps on them and record the model's state (``nxd_hf.model_setup.finish_parallel_model``:
weights, ties across stages, adapters, activation checkpointing, gradient reduction, device,
``model.nxd``) — as ``nxd_hf.parallelize`` does at pp=1. ``run_train`` then runs one step of the
chosen schedule. The record (``nxd``, ``nxd_hf.model_state``) is on this object; under
``nxd_hf.parallelize`` the HF model it was given carries the same one.
"""

import dataclasses
import math
import warnings

import torch
import torch.utils._pytree as pytree
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.pipeline import partition
from nxd_hf.pipeline.context import context_parallel_size, with_position_ids
from nxd_hf.pipeline.nxd_inputs import (
    default_microbatches, layer_kwargs_in_signature_order, named_inputs, outputs_as_tuple,
)
from nxd_hf.model_setup import LocalSetup, finish_parallel_model
from nxd_hf.model_setup.activation_checkpoint import decoder_layer_types
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.model_setup.materialize import refuse_deferred_init
from nxd_hf.moe.aux_loss import aux_loss_spec
from nxd_hf.pipeline.router_aux import RouterAuxLoss
from nxd_hf.pipeline.runtime import SCHEDULES, build_schedule, check_same_schedule, check_schedule
from nxd_hf.pipeline.recompute import allow_unmasked_attention, metadata_substitutes, recomputable_nodes
from nxd_hf.pipeline.stages import (MetadataByShape, NoneAtBoundary, boundaries, fake_propagate, flat_boundary_values, none_positions,
                                    split_stages, value_kinds)
from nxd_hf.pipeline.trace import make_tracer, trace_hf
from nxd_hf.pipeline.step import StepRunner
from nxd_hf.pipeline.stage_view import StageView
from nxd_hf.pipeline.ties import tie_across_stages


def _all_tensors(graph_module) -> dict[str, str]:
    """Value kinds of a plain module's graph, whose input dtypes are unknown before the first
    step: every value crossing a stage boundary must then be a tensor."""
    return {node.name: "tensor" for node in graph_module.graph.nodes}


def _resolve_classes(module: nn.Module, classes) -> tuple[type, ...]:
    """Module classes given as classes or as class names (NxD's guide passes ``__name__``)."""
    by_name = {type(m).__name__: type(m) for m in module.modules()}
    resolved = []
    for c in classes:
        if isinstance(c, type):
            resolved.append(c)
        elif c in by_name:
            resolved.append(by_name[c])
        else:
            raise ValueError(f"leaf_module_cls {c!r} is not a class of this model's modules")
    return tuple(resolved)


class NxDPPModel(nn.Module):
    """Pipeline-parallel model (see the module docstring; arguments as NxD's, plus ``schedule``
    — one of ``nxd_hf.pipeline.runtime.SCHEDULES`` — and ``activation_checkpoint_config``:
    "full", a module class or list of classes, or None). ``setup``: the local setup steps as
    ``nxd_hf.parallelize`` hands them over (a ``LocalSetup``); when constructing directly, give
    ``param_init_fn`` and ``activation_checkpoint_config`` instead. ``use_zero1_optimizer``:
    the optimizer does the data-parallel gradient reduction, not the end of ``run_train``.
    ``no_sync()`` defers that reduction for accumulation micro-steps, as in DDP."""

    def __init__(
        self, module: nn.Module, transformer_layer_cls=None, num_microbatches: int | None = None,
        virtual_pipeline_size: int = 1,
        output_loss_value_spec=None, return_mb_loss: bool = False, broadcast_and_average_loss: bool = False,
        pipeline_cuts: list[str] | None = None, input_names: list[str] | None = None, leaf_module_cls=None,
        autowrap_functions=None, autowrap_modules=None, tracer_cls=None, param_init_fn=None,
        trace_file_path: str | None = None, use_zero1_optimizer: bool = False, auto_partition: bool = False,
        deallocate_pipeline_outputs: bool = False, *, schedule: str | None = None,
        activation_checkpoint_config=None, setup: LocalSetup | None = None,
    ):
        super().__init__()
        with fail_together("NxDPPModel (tracing and splitting the model)"):  # before any collective
            refuse_deferred_init(module)
            num_microbatches = default_microbatches(num_microbatches)
            if num_microbatches < 1 or virtual_pipeline_size < 1:
                raise ValueError(f"num_microbatches ({num_microbatches}) and virtual_pipeline_size "
                                 f"({virtual_pipeline_size}) must be >= 1")
            if return_mb_loss and broadcast_and_average_loss:
                raise ValueError("return_mb_loss and broadcast_and_average_loss cannot both be True")
            if pipeline_cuts and auto_partition:
                raise ValueError("pass either pipeline_cuts or auto_partition=True, not both")
            self.is_hf = hasattr(module, "loss_function") and hasattr(module, "config")
            if output_loss_value_spec is not None and self.is_hf:
                warnings.warn("output_loss_value_spec is ignored for Hugging Face models: the last stage applies the "
                              "model's own loss_function to the logits", stacklevel=2)
            self.output_loss_value_spec = output_loss_value_spec
            self.pp_size = parallel_state.get_pipeline_model_parallel_size()
            self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            self.num_microbatches, self.virtual_pipeline_size = num_microbatches, virtual_pipeline_size
            self.schedule_name = schedule or ("1f1b" if virtual_pipeline_size == 1 else "interleaved_1f1b")
            self.return_mb_loss, self.broadcast_and_average_loss = return_mb_loss, broadcast_and_average_loss
            setup = _local_setup(setup, param_init_fn, activation_checkpoint_config, use_zero1_optimizer,
                                 buffer_init=getattr(module, "_init_weights", None))
            self.input_names = list(input_names or ["input_ids", "attention_mask", "labels"])
            self.cp_size = context_parallel_size(module)
            if self.cp_size > 1:
                self.input_names = with_position_ids(self.input_names)
            self.config = getattr(module, "config", None)
            self.layer_types = decoder_layer_types(module, transformer_layer_cls)
            # NxD's attribute: the class (a tuple only when several were given)
            self.transformer_layer_cls = self.layer_types[0] if len(self.layer_types) == 1 else self.layer_types
            # too many stages for the layers is the cause to name, before any schedule arithmetic
            num_layers = sum(isinstance(m, self.layer_types) for m in module.modules())
            partition.check_stage_count(num_layers, self.pp_size * virtual_pipeline_size)
            check_schedule(self.schedule_name, self.pp_size, virtual_pipeline_size, num_microbatches)
            self._deallocate = deallocate_pipeline_outputs

            traced_inputs = [n for n in self.input_names if n != "labels" or not self.is_hf]
            leaf_types = _resolve_classes(module, leaf_module_cls or ())
            tracer_kwargs = {}
            if autowrap_modules:
                tracer_kwargs["autowrap_modules"] = (math, *autowrap_modules)
            if autowrap_functions:
                tracer_kwargs["autowrap_functions"] = tuple(autowrap_functions)
            tracer = make_tracer(tracer_cls, self.layer_types, leaf_types, **tracer_kwargs)
            examples = self._example_inputs(traced_inputs)
            graph_module = trace_hf(module, traced_inputs, self.layer_types, leaf_types, examples, tracer)
            if not self.is_hf:
                self.output_loss_value_spec = outputs_as_tuple(graph_module, output_loss_value_spec)
            layer_kwargs_in_signature_order(graph_module, self.layer_types)
            if trace_file_path:
                with open(trace_file_path, "w") as f:
                    f.write(str(graph_module.graph))
            layers = [n.target for n in graph_module.graph.nodes
                      if n.op == "call_module" and isinstance(graph_module.get_submodule(n.target), self.layer_types)]
            self.num_stages = self.pp_size * virtual_pipeline_size
            cuts = pipeline_cuts or partition.auto_cuts(layers, self.num_stages)
            self.stage_of_layer = partition.stage_of_layers(layers, cuts, self.num_stages)
            self.pipeline_cuts = cuts
            self._kinds = (value_kinds(graph_module, examples, self.layer_types) if self.is_hf
                           else _all_tensors(graph_module))
            self._recomputed, substitutes = self._recomputation(graph_module, traced_inputs, set(layers))
            # the inputs reach every stage as keywords when stages recompute values from them
            self.keyword_inputs = list(traced_inputs) if self._recomputed else []
            all_stages = split_stages(graph_module, self.stage_of_layer, self._kinds, self._recomputed, substitutes)
            self._graph = [graph_module]  # the whole traced model, for per-shape stage metadata
            self._metadata_by_shape = MetadataByShape(self._propagated_metadata, graph_module)
            self._boundaries = boundaries(graph_module, self.stage_of_layer, self._recomputed)
            placement = SCHEDULES[self.schedule_name][1]
            self.stage_to_rank = partition.stage_ranks(self.num_stages, self.pp_size, placement)
            self.local_stage_ids = partition.local_stages(self.num_stages, self.pp_size, self.pp_rank, placement)
            self.stages = nn.ModuleDict({str(s): all_stages[s] for s in self.local_stage_ids})
        check_same_schedule(schedule=self.schedule_name, num_microbatches=num_microbatches,
                            virtual_pipeline_size=virtual_pipeline_size, pipeline_cuts=list(cuts))
        self.tied = tie_across_stages(all_stages, self.stage_to_rank, self.local_stage_ids)
        carriers = [self, module] if setup.record.on_hf_model else [self]  # not a submodule: only stages are children
        finish_parallel_model(module, self.local_modules(), setup, carriers=carriers, wrapper="pipeline",
                              layer_types=self.layer_types, tie=self.tied.sync_initial_values)
        self.nxd.grad_reduction.add_reduction(self.tied.sum_grads)
        self.router_aux = self._router_aux()
        self._runner = StepRunner(self)

    def _router_aux(self) -> RouterAuxLoss | None:
        """Hooks computing HF's load-balancing loss across stages, when the model adds one."""
        spec = aux_loss_spec(self.nxd.hf_model) if self.is_hf else None
        if spec is None:
            return None
        device = backend.collective_device(parallel_state.get_pipeline_model_parallel_group())
        return RouterAuxLoss(spec, self.local_modules(), self.layer_types, device)

    def _recomputation(self, graph_module, traced_inputs: list[str], layer_targets: set[str]):
        """(nodes every stage recomputes, per-boundary metadata stand-ins); none for a plain
        module, or when some boundary has no stand-in (see ``nxd_hf.pipeline.recompute``)."""
        if not self.is_hf:
            return frozenset(), None
        recomputed, sources = recomputable_nodes(graph_module, traced_inputs, layer_targets)
        crossings = boundaries(graph_module, self.stage_of_layer, recomputed)
        substitutes = metadata_substitutes(crossings, sources, self._kinds)
        if substitutes is None:
            return frozenset(), None
        allow_unmasked_attention(graph_module, recomputed)
        return recomputed, substitutes

    def _example_inputs(self, names: list[str]) -> list[torch.Tensor]:
        seq = 2 * parallel_state.get_tensor_model_parallel_size()  # any length SP can split
        return [torch.ones(1, seq, dtype=torch.long) for _ in names]

    def forward(self, *args, **inputs):
        raise ValueError("an NxDPPModel has no forward: call run_train(**inputs) (forward and backward of one step; "
                         "returns the loss) or run_eval(**inputs), on it or on nxd_hf.initialize_parallel_model's NxDModel")

    # -- NxD's API
    def run_train(self, *args, padded_rows: int = 0, **inputs):
        """One training step over ``num_microbatches`` microbatches; returns the loss. Inputs by
        name, or positionally in ``input_names`` order, or as one dict (a tokenizer's batch).
        Every PP rank passes the same full inputs (as in NxD): each stage recomputes the
        attention mask and positions from them. ``padded_rows`` as ``run_eval``'s; here it may
        be the whole batch (a data-parallel replica left without rows by a short last batch)."""
        return self._runner.run(named_inputs(self.input_names, args, inputs), train=True, padded_rows=padded_rows)

    def run_eval(self, *args, return_logits: bool = False, padded_rows: int = 0, **inputs):
        """Forward only; returns the loss (labels given) like ``run_train``. With
        ``return_logits=True`` (not in NxD), ``(loss, logits)``: the full logits ``[b, s, vocab]``,
        gathered over TP, unpadded, fp32, on every rank.
        ``padded_rows`` (not in NxD): the batch's last rows were added only to fill the microbatches
        (labels -100): HF's load-balancing loss leaves their tokens out too."""
        with torch.no_grad():
            return self._runner.run(named_inputs(self.input_names, args, inputs), train=False,
                                    return_logits=return_logits, padded_rows=padded_rows)

    @property
    def local_module(self):
        """NxD's attribute: this rank's stage module (a list with several stages per rank), seen
        as NxD's split module: its ``named_children()`` are the modules the stage calls (the
        transformer layers among them) under their dotted names, and ``add_module(name, m)``
        replaces one of them (NxD's activation-checkpointing sample wraps layers this way);
        everything else is the stage module's own."""
        views = [StageView(stage) for stage in self.stages.values()]
        return views[0] if len(views) == 1 else views

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.pp_rank

    def no_sync(self):
        """Skip the data-parallel gradient mean for steps inside the block (accumulation)."""
        return self.nxd.grad_reduction.no_sync()

    @property
    def hf_model(self) -> nn.Module:
        """The model this pipeline was built from (only this rank's stages hold its weights)."""
        return self.nxd.hf_model

    def local_modules(self) -> list[nn.Module]:
        """This rank's stage modules, in stage order; their parameters carry ``hf_model``'s names."""
        return list(self.stages.values())

    def local_named_parameters(self, *args, **kwargs):
        seen = set()
        for stage in self.stages.values():
            for name, param in stage.named_parameters(*args, **kwargs):
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def local_parameters(self, *args, **kwargs):
        for _, param in self.local_named_parameters(*args, **kwargs):
            yield param

    def local_named_modules(self, *args, **kwargs):
        for stage in self.stages.values():
            yield from stage.named_modules(*args, **kwargs)

    named_parameters = local_named_parameters  # only local parameters exist on this rank
    parameters = local_parameters

    def move_model_to_device(self) -> "NxDPPModel":
        from nxd_hf.parallel_layers.sharding import move_model_to_device

        move_model_to_device(self.stages, backend.default_device())
        return self

    @property
    def dtype(self) -> torch.dtype:
        return next(self.local_parameters()).dtype

    def stage_metadata(self, microbatch_inputs: list[torch.Tensor], *,
                       train: bool = True) -> dict[int, tuple[list, list, list, list]]:
        """(example inputs, example outputs, None input positions, None output positions) of each
        local stage for one microbatch shape, from a fake run of the whole traced model: torch's
        stages then never infer shapes by running a forward on unreceived buffers (which breaks
        on values such as GPT-2's output shape). The None positions: boundary values that are
        None for these inputs (``NoneAtBoundary``), left out of the examples. One fake run per
        shape (``MetadataByShape``: evaluation reuses training's, ``train=False``)."""
        return self._metadata_by_shape(microbatch_inputs, train=train)

    def _propagated_metadata(self, microbatch_inputs: list[torch.Tensor]) -> dict[int, tuple[list, list, list, list]]:
        graph_module = self._graph[0]
        fake_propagate(graph_module, microbatch_inputs, self.layer_types)
        output_node = next(n for n in graph_module.graph.nodes if n.op == "output")
        flat = [flat_boundary_values(nodes, self._kinds) for nodes in self._boundaries]
        meta = {}
        for s in self.local_stage_ids:
            num_positional = len(microbatch_inputs) - len(self.keyword_inputs)
            inputs = microbatch_inputs[:num_positional] if s == 0 else flat[s - 1]
            if s == self.num_stages - 1:
                outputs = pytree.tree_leaves(torch.fx.node.map_arg(output_node.args[0], lambda n: n.meta["val"]))
            else:
                outputs = flat[s]
            meta[s] = ([_as_meta(t) for t in inputs if t is not None], [_as_meta(t) for t in outputs if t is not None],
                       none_positions(inputs) if s else [], none_positions(outputs) if s < self.num_stages - 1 else [])
        return meta

    def build_schedule(self, loss_fn, microbatch_inputs: list[torch.Tensor], *, train: bool = True):
        group = parallel_state.get_pipeline_model_parallel_group()
        compute = next((p.device for p in self.local_parameters()), backend.default_device())
        send = backend.p2p_device(group, compute)
        meta = self.stage_metadata(microbatch_inputs, train=train)
        modules = {s: NoneAtBoundary(self.stages[str(s)], meta[s][2], meta[s][3]) if meta[s][2] or meta[s][3]
                   else self.stages[str(s)] for s in self.local_stage_ids}
        return build_schedule(
            self.schedule_name, modules, self.num_stages,
            device=send, group=backend.p2p_group(group), compute_device=compute,
            num_microbatches=self.num_microbatches, loss_fn=loss_fn, deallocate_outputs=self._deallocate,
            stage_metadata={s: m[:2] for s, m in meta.items()}, layer_types=self.layer_types,
        )


def _local_setup(setup: LocalSetup | None, param_init_fn, activation_checkpoint_config,
                 use_zero1_optimizer: bool, *, buffer_init) -> LocalSetup:
    if setup is None:
        return LocalSetup(param_init_fn=param_init_fn, activation_checkpoint_config=activation_checkpoint_config,
                          dp_in_optimizer=use_zero1_optimizer, buffer_init=buffer_init)
    if param_init_fn is not None or activation_checkpoint_config is not None:
        raise ValueError("NxDPPModel got setup= together with param_init_fn or activation_checkpoint_config: "
                         "put them in the LocalSetup (nxd_hf.parallelize takes them as its own arguments)")
    return dataclasses.replace(setup, dp_in_optimizer=setup.dp_in_optimizer or use_zero1_optimizer)


def _as_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)
