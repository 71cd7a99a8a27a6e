"""A parallelized model refuses torch's ``DistributedDataParallel``.

Wrapping it (what plain ``transformers.Trainer`` does through accelerate under torchrun, or a
loop's own ``DDP(model)``) would broadcast rank 0's parameters to every rank, replacing each TP
rank's shard with rank 0's, silently, and then average the gradients over every rank, the TP
shards included. nxd_hf averages the gradients over the data-parallel ranks itself. DDP reads
``module._ddp_params_and_buffers_to_ignore`` before it touches a parameter; a parallel model's
is ``RefuseDDP``, whose iteration raises the ValueError that says what to use instead. DDP reads
it on the module it wraps only: a module that holds the parallel model (a LightningModule under
Lightning's "ddp" strategy) is not caught here; train it with ``nxd_hf.lightning.NxDStrategy``.
"""

from torch import nn

MESSAGE = (
    "this model was parallelized by nxd_hf, which averages its gradients over the data-parallel ranks itself: "
    "do not wrap it in torch's DistributedDataParallel, which would overwrite every rank's tensor-parallel "
    "shards with rank 0's and average gradients over the tensor-parallel ranks too. Plain transformers.Trainer "
    "(accelerate) wraps it so under torchrun: use nxd_hf.NxDTrainer (same arguments); in your own loop, call "
    "the model directly (nxd_hf.parallel_layers.clip_grad_norm or torch's clip_grad_norm_ clip by the whole "
    "model's norm)"
)


class RefuseDDP:
    """What DDP finds as the names of parameters to ignore: reading them raises ``MESSAGE``."""

    def __iter__(self):
        raise ValueError(MESSAGE)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return "RefuseDDP()"


def refuse_ddp(module: nn.Module) -> None:
    module._ddp_params_and_buffers_to_ignore = RefuseDDP()
