"""The pipeline runtime: ``torch.distributed.pipelining`` stages and schedules, built per input
shape.

torch's ``PipelineStage`` infers the shapes of the values it sends from the first microbatch
and keeps them; a batch of another sequence length needs new stages. So stages and schedule
are built per input signature (shapes and dtypes) and cached — the one thing written here
instead of taken from torch. The runtime's own gradient scaling is off: the loss is already
normalized by the step's global token count.
"""

import warnings

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

SCHEDULES = {
    "1f1b": (S.Schedule1F1B, "looped", False),
    "gpipe": (S.ScheduleGPipe, "looped", False),
    "interleaved_1f1b": (S.ScheduleInterleaved1F1B, "looped", True),
    "looped_bfs": (S.ScheduleLoopedBFS, "looped", True),
    "interleaved_zero_bubble": (S.ScheduleInterleavedZeroBubble, "looped", True),
    "zbv": (S.ScheduleZBVZeroBubble, "v_shape", True),
}
"""name -> (torch schedule class, stage placement, runs several stages per rank)."""


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
    if name in ("interleaved_1f1b", "interleaved_zero_bubble") and num_microbatches % pp_size != 0:
        raise ValueError(
            f"schedule {name!r} needs num_microbatches ({num_microbatches}) to be a multiple of the pipeline "
            f"parallel size ({pp_size}); e.g. num_microbatches={pp_size * max(1, num_microbatches // pp_size)}"
        )


class DeallocatingStage(PipelineStage):
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


def build_schedule(name: str, stage_modules: dict[int, torch.nn.Module], num_stages: int, *, device, group,
                   num_microbatches: int, loss_fn, deallocate_outputs: bool, stage_metadata: dict):
    """A torch schedule over this rank's stages (``stage_modules``: stage index -> module;
    ``stage_metadata``: stage index -> (example inputs, example outputs), static shapes)."""
    schedule_cls, _, multi = SCHEDULES[name]
    if deallocate_outputs and name != "1f1b":
        warnings.warn(f"deallocate_pipeline_outputs is implemented for the '1f1b' schedule only; "
                      f"ignored with {name!r}", stacklevel=3)
        deallocate_outputs = False
    stage_cls = DeallocatingStage if deallocate_outputs else PipelineStage
    stages = [
        stage_cls(module, index, num_stages, device, input_args=tuple(stage_metadata[index][0]),
                  output_args=tuple(stage_metadata[index][1]), group=group)
        for index, module in sorted(stage_modules.items())
    ]
    kwargs = dict(n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_cls(stages if multi else stages[0], **kwargs)
