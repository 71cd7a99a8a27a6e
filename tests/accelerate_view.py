"""What accelerate infers about the processes, for the Trainer cases.

``one_process_reference_args``: the reference ``transformers.Trainer`` runs as one process on every
rank (the single-process run NxDTrainer is compared with), never DDP over the ranks — which on a
GPU shared by two ranks would ask rank 1 for ``cuda:1``.

``accelerate_infers_gpus``: on the CPU, accelerate infers what it infers under torchrun on a
machine with a GPU — ``DistributedType.MULTI_GPU``, one process per rank — so that the CPU suite
drives the data path of the GPU lane (``Trainer``'s loaders prepared by an ``Accelerator`` that
sees several processes). The inferred type is all that is forced: the ranks, collectives and
loaders are real.
"""

import contextlib
import os
from unittest import mock

import transformers
from accelerate.state import PartialState
from accelerate.utils import DistributedType

from nxd_hf import backend


def one_process_reference_args(**kwargs) -> transformers.TrainingArguments:
    hidden = {name: os.environ.pop(name) for name in ("LOCAL_RANK",) if name in os.environ}
    try:  # without LOCAL_RANK accelerate sees a plain `python script.py` run: no distribution
        return transformers.TrainingArguments(**kwargs)
    finally:
        os.environ.update(hidden)


@contextlib.contextmanager
def accelerate_infers_gpus():
    inferred = PartialState._prepare_backend

    def as_on_a_gpu(self, cpu=False, sagemaker_dp=False, backend_name=None):
        if int(os.environ.get("LOCAL_RANK", -1)) != -1 and not cpu:  # accelerate's branch for CUDA
            return backend_name or "nccl", DistributedType.MULTI_GPU
        return inferred(self, cpu, sagemaker_dp, backend_name)

    device = str(backend.default_device())  # PartialState.set_device would pick cuda:LOCAL_RANK
    with mock.patch.object(PartialState, "_prepare_backend", as_on_a_gpu), \
            mock.patch.dict(os.environ, {"ACCELERATE_TORCH_DEVICE": device}):
        yield
