"""The pipeline runtime: ``torch.distributed.pipelining`` stages and schedules, built per input
shape.

torch's ``PipelineStage`` infers the shapes of the values it sends from the first microbatch
and keeps them; a batch of another sequence length needs new stages. So stages and schedule
are built per input signature (shapes and dtypes) and cached — the one thing written here
instead of taken from torch. The runtime's own gradient scaling is off: the loss is already
normalized by the step's global token count. Two stage subclasses change what torch's stage
does: ``DeallocatingStage`` (frees sent activations) and ``SplitBackwardFirstStage`` (gives the
first stage a real input-gradient step for the zero-bubble schedules); their base ``Stage``
fixes torch's ``eval`` for V-shaped schedules and leaves the stage where the setup sequence
put it. Where sends cannot carry the compute device's tensors (gloo with CUDA: see
``nxd_hf.backend.p2p_device``), ``stage_through`` stages them through the CPU.
"""

import warnings

import torch
from torch import fx
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._pytree import tree_map

from nxd_hf import backend

SCHEDULES = {
    "1f1b": (S.Schedule1F1B, "looped", False),
    "gpipe": (S.ScheduleGPipe, "looped", False),
    "interleaved_1f1b": (S.ScheduleInterleaved1F1B, "looped", True),
    "looped_bfs": (S.ScheduleLoopedBFS, "looped", True),
    "interleaved_zero_bubble": (S.ScheduleInterleavedZeroBubble, "looped", True),
    "zbv": (S.ScheduleZBVZeroBubble, "v_shape", True),
}
"""name -> (torch schedule class, stage placement, runs several stages per rank)."""

SPLIT_BACKWARD = frozenset({"interleaved_zero_bubble", "zbv"})
"""Schedules that split each backward into an input-gradient (I) and a weight-gradient (W) step."""


def check_schedule(name: str, pp_size: int, virtual_pipeline_size: int, num_microbatches: int) -> None:
    """ValueError naming what works for an impossible schedule request."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    _, placement, multi = SCHEDULES[name]
    if multi and virtual_pipeline_size < 2 and name != "interleaved_zero_bubble":
        raise ValueError(f"schedule {name!r} runs several stages per rank: set virtual_pipeline_size >= 2")
    if not multi and virtual_pipeline_size > 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank: use virtual_pipeline_size=1 or an "
                         "interleaved schedule ('interleaved_1f1b', 'interleaved_zero_bubble', 'zbv')")
    if placement == "v_shape" and virtual_pipeline_size != 2:
        raise ValueError("schedule 'zbv' places exactly 2 stages per rank (V shape): set virtual_pipeline_size=2")
    if name == "1f1b" and num_microbatches < pp_size:
        raise ValueError(f"schedule '1f1b' needs num_microbatches ({num_microbatches}) >= the pipeline parallel size "
                         f"({pp_size}): pass num_microbatches={pp_size} or more (or schedule='gpipe')")
    if name in ("interleaved_1f1b", "interleaved_zero_bubble") and num_microbatches % pp_size != 0:
        raise ValueError(
            f"schedule {name!r} needs num_microbatches ({num_microbatches}) to be a multiple of the pipeline "
            f"parallel size ({pp_size}); e.g. num_microbatches={pp_size * max(1, num_microbatches // pp_size)}"
        )


def check_same_schedule(**settings) -> None:
    """ValueError on every rank when the ranks were given different schedule ``settings``
    (collective over the world): a rank stepping other microbatches than its peers would pair its
    sends, and its experts' all-to-alls (``nxd_hf.moe.ep_dispatch``), with the wrong ones, or hang."""
    everyone = backend.all_gather_object(settings)
    differ = [f"{key}: " + ", ".join(f"rank {r}: {s[key]!r}" for r, s in enumerate(everyone))
              for key in settings if any(s[key] != settings[key] for s in everyone)]
    if differ:
        raise ValueError("the pipeline was set up with different schedules on different ranks (" + "; ".join(differ)
                         + "): every rank must pass the same num_microbatches, schedule, virtual_pipeline_size and pipeline_cuts")


class Stage(PipelineStage):
    """torch's stage, fixed for ``eval`` under V-shaped schedules: torch 2.13's ``eval`` runs the
    schedule's backward actions as no-ops but still hands gradients between a rank's adjacent
    stages, which asserts on a stage without backward. Here that hand-over is a no-op too.
    torch moves the stage module to the stage's (send) device; nxd_hf placed it already."""

    def _move_submod_to_device(self) -> None:
        pass

    def get_local_bwd_output(self, mb_index: int):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


class DeallocatingStage(Stage):
    """A stage that frees the storage of each sent activation once its send has completed
    (Megatron's deallocate_pipeline_outputs). Autograd keeps the tensor's metadata and
    ``grad_fn``, which is all the stage's backward needs. Schedule1F1B completes a chunk's send
    before the next chunk's send ops are requested and before any backward, which is where
    freeing happens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sent: list[torch.Tensor] = []
        self.freed_bytes = 0

    def _free_sent(self) -> None:
        for tensor in self._sent:
            self.freed_bytes += tensor.untyped_storage().nbytes()
            tensor.untyped_storage().resize_(0)
        self._sent = []

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        self._free_sent()
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if self.is_last:  # nothing is sent; the outputs feed the loss
            return ops
        outputs, inputs = self.fwd_cache[fwd_chunk_id]
        input_storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        self._sent = [t for t in outputs if isinstance(t, torch.Tensor) and t.is_floating_point()
                      and t.requires_grad and t.untyped_storage().data_ptr() not in input_storages]
        return ops

    def backward_one_chunk(self, *args, **kwargs):
        self._free_sent()
        return super().backward_one_chunk(*args, **kwargs)


class SplitBackwardFirstStage(Stage):
    """The first stage of a zero-bubble schedule, with a real input-gradient step.

    torch's first stage has no input that needs a gradient (token ids), so its I step is empty
    and its W step runs the whole backward: 0 and 2 units of work where the schedule plans 1
    and 1, which opens bubbles the schedule does not plan for. Here the tensors entering the
    stage's first transformer layer (the hidden state) are detached into leaves during
    forward. I propagates the gradient through the layers down to those leaves, the same
    activation-gradient chain every other stage's I computes. W then computes the layers'
    weight gradients from the saved intermediates and backpropagates the leaves' gradients
    through what precedes the first layer (the embeddings). The gradients are those of the
    undivided backward. Relies on ``PipelineStage`` internals (``fwd_cache``, ``dw_runner``,
    ``bwd_cache``, ``_retrieve_recv_grads``) as of torch 2.13; torch notes the same split as a
    TODO in ``backward_weight_one_chunk``."""

    def __init__(self, *args, first_layer: torch.nn.Module, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.is_first and not self.is_last
        self._first_layer = first_layer
        self._cuts: dict[int, tuple[list, list]] = {}  # chunk -> (tensors entering the first layer, their leaves)
        self._weight_steps: dict[int, tuple] = {}

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        roots, leaves = cut = [], []

        def to_leaf(value):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                roots.append(value)
                leaves.append(value.detach().requires_grad_())
                return leaves[-1]
            return value

        def detach_inputs(module, layer_args, layer_kwargs):
            return tree_map(to_leaf, layer_args), tree_map(to_leaf, layer_kwargs)

        handle = self._first_layer.register_forward_pre_hook(detach_inputs, with_kwargs=True)
        try:
            output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            handle.remove()
        if leaves:
            self._cuts[fwd_chunk_id] = cut
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        roots, leaves = self._cuts.pop(bwd_chunk_id, ([], []))
        if full_backward or not leaves:
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            if full_backward:
                _backward_from_leaves(roots, leaves)
            return
        stage_output, _ = self.fwd_cache.pop(bwd_chunk_id)
        output_grads = self._retrieve_recv_grads(bwd_chunk_id)
        # only outputs that carry a gradient: torch detaches the outputs it is given in place,
        # which fails on views such as passed-on position ids
        carried = [i for i, t in enumerate(stage_output) if isinstance(t, torch.Tensor) and t.requires_grad]
        _, param_groups = stage_backward_input([stage_output[i] for i in carried], [output_grads[i] for i in carried],
                                               leaves, self.submod.parameters())
        self._weight_steps[bwd_chunk_id] = (param_groups, roots, leaves)
        self.dw_runner[bwd_chunk_id] = lambda: None  # torch's W step checks that I ran
        self.bwd_cache[bwd_chunk_id] = ()  # the first stage sends no gradient

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        if bwd_chunk_id not in self._weight_steps:
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self.dw_runner.pop(bwd_chunk_id)
        param_groups, roots, leaves = self._weight_steps.pop(bwd_chunk_id)
        stage_backward_weight(self.submod.parameters(), param_groups)
        _backward_from_leaves(roots, leaves)


def _backward_from_leaves(roots: list[torch.Tensor], leaves: list[torch.Tensor]) -> None:
    """Backpropagate the leaves' gradients into the graph the leaves were detached from."""
    pairs = [(root, leaf.grad) for root, leaf in zip(roots, leaves) if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([root for root, _ in pairs], [grad for _, grad in pairs])


def _first_layer(stage_module: torch.nn.Module, layer_types: tuple[type, ...]) -> torch.nn.Module | None:
    """The first transformer layer the stage calls: in graph order for an FX stage, else in
    registration order."""
    stage_module = getattr(stage_module, "stage", stage_module)  # under stages.NoneAtBoundary
    if isinstance(stage_module, fx.GraphModule):
        modules = (stage_module.get_submodule(n.target) for n in stage_module.graph.nodes if n.op == "call_module")
    else:
        modules = stage_module.modules()
    return next((m for m in modules if isinstance(m, layer_types)), None)


def stage_through(module: torch.nn.Module, compute_device: torch.device, send_device: torch.device, *,
                  is_last: bool) -> None:
    """Make ``module`` take its inputs on any device (moved to ``compute_device``) and hand its
    outputs over on ``send_device`` (the last stage's feed the loss and stay). The moves are
    in the autograd graph, so the gradients torch's stage sends back are on ``send_device``
    too. Once per module: stages are rebuilt per input shape around the same modules."""
    if getattr(module, "_nxd_staged_through", None) == send_device:
        return
    module._nxd_staged_through = send_device

    def to(device):
        return lambda v: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v

    module.register_forward_pre_hook(lambda m, args, kwargs: (tree_map(to(compute_device), args),
                                                              tree_map(to(compute_device), kwargs)), with_kwargs=True)
    if not is_last:
        module.register_forward_hook(lambda m, args, output: tree_map(to(send_device), output))


def build_schedule(name: str, stage_modules: dict[int, torch.nn.Module], num_stages: int, *, device, group,
                   num_microbatches: int, loss_fn, deallocate_outputs: bool, stage_metadata: dict,
                   layer_types: tuple[type, ...] = (), compute_device: torch.device | None = None):
    """A torch schedule over this rank's stages (``stage_modules``: stage index -> module;
    ``stage_metadata``: stage index -> (example inputs, example outputs), static
    shapes; ``layer_types``: the transformer layer classes). ``device`` is where sent and
    received tensors live; when it is not ``compute_device`` (the stages' own), they are
    staged through it (``stage_through``)."""
    schedule_cls, _, multi = SCHEDULES[name]
    if deallocate_outputs and name != "1f1b":
        warnings.warn(f"deallocate_pipeline_outputs is implemented for the '1f1b' schedule only; "
                      f"ignored with {name!r}", stacklevel=3)
        deallocate_outputs = False
    stages = []
    for index, module in sorted(stage_modules.items()):
        if compute_device is not None and torch.device(compute_device) != torch.device(device):
            stage_through(module, torch.device(compute_device), torch.device(device), is_last=index == num_stages - 1)
        stage_cls, extra = DeallocatingStage if deallocate_outputs else Stage, {}
        first_layer = _first_layer(module, layer_types) if index == 0 and name in SPLIT_BACKWARD else None
        if first_layer is not None and num_stages > 1:
            stage_cls, extra = SplitBackwardFirstStage, dict(first_layer=first_layer)
        stages.append(stage_cls(module, index, num_stages, device, input_args=tuple(stage_metadata[index][0]),
                                output_args=tuple(stage_metadata[index][1]), group=group, **extra))
    kwargs = dict(n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_cls(stages if multi else stages[0], **kwargs)
