"""``NxDStrategy`` (the document's ``NeuronXLAStrategy``): Lightning's strategy for processes that
torchrun (or anything that initializes ``torch.distributed`` first) started; nxd_hf's backend picks
gloo, nccl or XLA. The model and optimizer are nxd_hf's, so the strategy wraps nothing: it sets up
``parallel_state``, hands each data-parallel replica its share of the data, reduces logged metrics
over data parallelism and saves Lightning checkpoints as nxd_hf checkpoints."""

import contextlib
import os
import shutil
import warnings

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint import load_checkpoint, save_checkpoint, store
from nxd_hf.lightning.callbacks import NeuronTensorBoardLogger
from nxd_hf.lightning.flavor import ClusterEnvironment, ParallelStrategy, fabric_rank_zero_only, rank_zero_only
from nxd_hf.lightning.module import NeuronLTModule
from nxd_hf.lightning.plain_module import (
    ModelShareOfOptimizer, PlainModuleParallel, clip_by_global_norm, sync_metrics_over_data_parallel,
)
from nxd_hf.parallel_sizes import ParallelSizes

LIGHTNING_STATE = "lightning_state.pt"
"""The rest of Lightning's checkpoint dict (loops, callbacks, schedulers), beside nxd_hf's files."""
OUTSIDE_STATE = "nxd_hf_outside_model"
"""In it, for a LightningModule of one's own: its tensors outside the Hugging Face model."""


class ProcessGroupEnvironment(ClusterEnvironment):
    """Ranks as ``torch.distributed`` (initialized by ``setup_environment``) or torchrun's
    variables say; the processes are always created outside Lightning."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", 0))

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return backend.world_size() if torch.distributed.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))

    def set_world_size(self, size: int) -> None:
        pass  # torch.distributed's

    def global_rank(self) -> int:
        return backend.rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.global_rank()))

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", 0))


class NxDStrategy(ParallelStrategy):
    """``tensor_parallel_size``/``pipeline_parallel_size`` are read from ``nxd_config`` when it is
    given. ``save_load_xser`` is accepted for NxD's signature; nxd_hf always writes safetensors.
    Besides NxD's ``NeuronLTModule``, a LightningModule of one's own trains here too (not in NxD):
    its Hugging Face models are parallelized before ``configure_optimizers`` (``plain_module``)."""

    strategy_name = "nxd"

    def __init__(self, nxd_config=None, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 save_load_xser: bool = False, checkpoint_io=None, precision_plugin=None):
        super().__init__(cluster_environment=ProcessGroupEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if save_load_xser:
            warnings.warn("NxDStrategy: save_load_xser is ignored: nxd_hf always writes safetensors", stacklevel=2)
        if nxd_config is not None:
            tensor_parallel_size, pipeline_parallel_size = nxd_config.tensor_parallel_size, nxd_config.pipeline_parallel_size
        ParallelSizes.check_sizes(tp=tensor_parallel_size, pp=pipeline_parallel_size)
        self.nxd_config = nxd_config
        self.tensor_parallel_size, self.pipeline_parallel_size = tensor_parallel_size, pipeline_parallel_size
        self.plain: PlainModuleParallel | None = None
        """Set up for a LightningModule of the user's own (None for a NeuronLTModule)."""

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning's connector then puts a DistributedSampler on the dataloaders

    @property
    def root_device(self) -> torch.device:
        return backend.default_device()

    @property
    def data_parallel_size(self) -> int:
        return parallel_state.get_data_parallel_size()

    @property
    def distributed_sampler_kwargs(self) -> dict:
        # by data-parallel replica: the ranks of one TP/PP group read the same batch
        return {"num_replicas": parallel_state.get_data_parallel_size(), "rank": parallel_state.get_data_parallel_rank()}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # nxd_hf loads into the optimizer in place: it must exist first

    def setup_environment(self) -> None:
        backend.init_process_group_from_env()
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        config = getattr(self.lightning_module, "nxd_config", None)
        if config is not None and (config.tensor_parallel_size, config.pipeline_parallel_size) != (tp, pp):
            raise ValueError(f"NxDStrategy(tensor_parallel_size={tp}, pipeline_parallel_size={pp}) does not match the "
                             f"module's nxd_config (tp={config.tensor_parallel_size}, pp={config.pipeline_parallel_size}): "
                             "pass the module's config, NxDStrategy(nxd_config)")
        ready = parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_tensor_model_parallel_size(), parallel_state.get_pipeline_model_parallel_size()) == (tp, pp)
        if not ready:
            if self.nxd_config is not None and parallel_state.model_parallel_is_initialized():
                raise ValueError(f"NxDStrategy: parallel_state was changed after neuronx_distributed_config(tp={tp}, "
                                 f"pp={pp}): build the config again, then the Trainer")
            parallel_state.initialize_model_parallel(tp, pp)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank
        module = self.lightning_module
        if hasattr(module, "log_rank0") and module._trainer is not None:
            # before Lightning opens the loggers' writers: they write from the rank the module logs on
            for logger in module.trainer.loggers:
                if isinstance(logger, NeuronTensorBoardLogger):
                    logger.log_rank0 = module.log_rank0
        super().setup_environment()

    def _setup_model(self, model):
        """After ``configure_model``, before ``configure_optimizers``: a NeuronLTModule's model is
        nxd_hf's already; a module of the user's own gets its Hugging Face models parallelized."""
        sync_metrics_over_data_parallel(model)
        if not isinstance(model, NeuronLTModule) and self.plain is None:
            if self.nxd_config is not None:
                raise ValueError(
                    f"NxDStrategy(nxd_config) with {type(model).__name__}, a LightningModule of its own: nxd_config "
                    "describes the model and optimizer that NeuronLTModule builds. Pass the sizes instead, "
                    "NxDStrategy(tensor_parallel_size=...), or build the module as a NeuronLTModule")
            self.plain = PlainModuleParallel(model, tensor_parallel_size=self.tensor_parallel_size,
                                             pipeline_parallel_size=self.pipeline_parallel_size)
            model.to(self.root_device)  # parallelize placed its models; the module's own layers follow
        return model

    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        # gradient_clip_val (by norm): the norm of the whole model, not of this rank's shards, under
        # whichever precision plugin Lightning chose
        self.precision_plugin.clip_grad_by_norm = clip_by_global_norm

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning's accumulation micro-steps: no data-parallel mean, as DDP's ``no_sync``."""
        with self.plain.no_sync() if self.plain is not None else contextlib.nullcontext():
            yield

    def post_backward(self, closure_loss) -> None:
        if self.plain is not None:
            self.plain.after_backward()

    def model_to_device(self) -> None:
        pass  # initialize_parallel_model or parallelize placed it

    def tensor_init_context(self, empty_init=None):
        return contextlib.nullcontext()  # initialize_parallel_model decides where parameters are built

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """Over data parallelism: the ranks of one TP/PP group hold the same values."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = _REDUCE_OPS.get(str(reduce_op).lower().rsplit(".", 1)[-1])  # strings and torch's ReduceOp
        if op is None:
            raise ValueError(f"NxDStrategy.reduce: reduce_op {reduce_op!r} is not supported: use 'mean', 'sum', "
                             "'max' or 'min'")
        group = parallel_state.get_data_parallel_group() if group is None else group
        out = backend.all_reduce(tensor.detach().clone().float(), group, "sum" if op == "mean" else op)
        return out / backend.group_size(group) if op == "mean" else out

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank (early stopping, checkpoint callbacks)."""
        votes = torch.tensor(int(decision), device=backend.collective_device())
        backend.all_reduce(votes, None)
        return bool(votes == backend.world_size()) if all else bool(votes)

    def barrier(self, name=None) -> None:
        backend.barrier()

    def broadcast(self, obj, src: int = 0):
        return backend.all_gather_object(obj)[src]

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        return backend.all_gather(tensor.unsqueeze(0), 0, group)

    # checkpoints: nxd_hf's files (any parallel sizes load them) plus Lightning's own state

    def lightning_module_state_dict(self) -> dict:
        return {}  # written by save_checkpoint from the model itself

    def optimizer_state(self, optimizer) -> dict:
        return {}

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Every rank calls it; ``filepath`` becomes a checkpoint directory (nxd_hf's ``path/tag``)."""
        if storage_options is not None:
            raise ValueError("NxDStrategy.save_checkpoint: storage_options are not supported")
        rest = dict(checkpoint)  # its state_dict and optimizer_states are empty: nxd_hf writes those
        path, tag = os.path.split(os.path.abspath(os.fspath(filepath)))
        # save_checkpoint(weights_only=True), ModelCheckpoint(save_weights_only=True): Lightning leaves
        # the optimizer out of its dict; so does nxd_hf's checkpoint
        optimizer = _nxd_optimizer(self.optimizers) if "optimizer_states" in checkpoint else None
        model, model_optimizer = self._checkpoint_parts(optimizer)
        if self.plain is not None:
            rest[OUTSIDE_STATE] = self.plain.outside_state(self.lightning_module, optimizer)
        save_checkpoint(path, tag, model=model, optimizer=model_optimizer,
                        side_files=lambda directory: torch.save(rest, os.path.join(directory, LIGHTNING_STATE)))

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path, tag = os.path.split(os.path.abspath(os.fspath(checkpoint_path)))
        state = _lightning_state(checkpoint_path)
        # a weights-only checkpoint: Lightning then says, as for its own, that it holds no optimizer state
        optimizer = _nxd_optimizer(self.optimizers) if "optimizer_states" in state else None
        model, model_optimizer = self._checkpoint_parts(optimizer)
        load_checkpoint(path, tag, model=model, optimizer=model_optimizer)
        outside = state.pop(OUTSIDE_STATE, {"tensors": {}, "optimizer": {}})  # a NeuronLTModule's: its model only
        if self.plain is not None:
            self.plain.load_outside_state(self.lightning_module, optimizer, outside)
        return state

    def _checkpoint_parts(self, optimizer):
        """(model, optimizer) for nxd_hf's checkpoint: a NeuronLTModule's; for a module of one's own,
        its Hugging Face model and the optimizer's share of it (the rest is ``OUTSIDE_STATE``)."""
        module = self.lightning_module
        if self.plain is None:
            return module.model, optimizer
        model = self.plain.checkpoint_model(type(module).__name__, optimizer)
        return model, None if optimizer is None else ModelShareOfOptimizer(optimizer, model)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint filled the model

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # and the optimizer

    def remove_checkpoint(self, filepath) -> None:
        """ModelCheckpoint's rotation: the tracker first, then the directory (as nxd_hf's pruning)."""
        if self.is_global_zero:
            path, tag = os.path.split(os.path.abspath(os.fspath(filepath)))
            kept = [t for t in store.read_tracker(path)["complete"] if t != tag]
            store.write_tracker(path, kept[-1] if kept else None, kept)
            shutil.rmtree(filepath, ignore_errors=True)


def checkpoint_progress(checkpoint_path) -> dict:
    """``{"global_step", "epoch"}`` of a Lightning checkpoint that ``NxDStrategy`` saved, read on
    the host before ``fit``: Lightning's ``max_steps``/``max_epochs`` count from the run's start, so
    a resumed run that should train more sets them past these."""
    state = _lightning_state(checkpoint_path)
    return {"global_step": int(state["global_step"]), "epoch": int(state["epoch"])}


def _lightning_state(checkpoint_path) -> dict:
    state_file = os.path.join(os.fspath(checkpoint_path), LIGHTNING_STATE)
    if not os.path.isfile(state_file):
        raise ValueError(f"{checkpoint_path} is not a Lightning checkpoint saved by NxDStrategy: it has no "
                         f"{LIGHTNING_STATE}; pass the path given to trainer.save_checkpoint (or a ModelCheckpoint's)")
    # our own file, written by rank 0 of a job of this project: Lightning's loops hold plain objects
    return torch.load(state_file, weights_only=False)


_REDUCE_OPS = {"none": "mean", "mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


def _nxd_optimizer(optimizers: list):
    if len(optimizers) > 1:
        raise ValueError(f"NxDStrategy: one optimizer per module is supported, got {len(optimizers)}")
    return optimizers[0] if optimizers else None


NeuronXLAStrategy = NxDStrategy
"""NxD's name."""
