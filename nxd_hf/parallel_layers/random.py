"""Model-parallel RNG (Megatron's RNG tracker), for CPU, CUDA and XLA generators alike.

Dropout in a replicated region (e.g. after a RowParallelLinear) must draw the same mask on
every TP rank, or the replicas drift apart; dropout in a sharded region (attention
probabilities of the local heads) must draw an independent mask per rank.
``model_parallel_manual_seed(seed)`` seeds the default generator identically on every TP rank
(offset per PP stage) and a tracked "model-parallel" generator differently per TP rank;
``get_rng_state_tracker().fork()`` runs a block on the tracked generator.

A pipeline step runs each stage on its own stream (``pipeline_stage_rng``): without it every
stage would start from the same state, so stage 1's dropout masks would repeat stage 0's, and
the stages' default generators would drift apart by the different number of draws of their
layers (a sampler seeded from the default generator would then feed the stages different
batches). NxD gets the offset from ``model_parallel_manual_seed``; HF's ``Trainer`` reseeds
every rank alike with ``set_seed``, so nxd_hf derives the stream per step instead.
"""

import contextlib

import torch

from nxd_hf import backend, parallel_state

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718
_PP_SEED_OFFSET = 100


def _device_type() -> str:
    return backend.default_device().type


def _get_state():
    device_type = _device_type()
    if device_type == "xla":
        import torch_xla.core.xla_model as xm  # optional extra

        return xm.get_rng_state()
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(state) -> None:
    device_type = _device_type()
    if device_type == "xla":
        import torch_xla.core.xla_model as xm  # optional extra

        xm.set_rng_state(state)
    elif device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)  # seeds CPU and CUDA generators
    if _device_type() == "xla":
        _set_state(seed)


class RNGStatesTracker:
    """Named generator states; ``fork(name)`` swaps one in for the duration of a block."""

    def __init__(self):
        self.states = {}

    def reset(self) -> None:
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state()
        _seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise ValueError(
                f"RNG state {name!r} is not set: call nxd_hf.parallel_layers.random.model_parallel_manual_seed(seed)"
            )
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


_tracker = RNGStatesTracker()


def get_rng_state_tracker() -> RNGStatesTracker:
    return _tracker


def model_parallel_manual_seed(seed: int) -> None:
    """Seed replicated regions with ``seed + 100 * pp_rank`` (equal on every TP rank) and the
    tracked sharded-region generator with ``seed + 2718 + tp_rank`` (different per TP rank)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    _tracker.reset()
    _tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank + _PP_SEED_OFFSET * pp_rank)
    _seed(seed + _PP_SEED_OFFSET * pp_rank)


def draw_step_seed() -> int:
    """One draw from the default CPU generator: equal on every rank whose generator is in step."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))  # the CPU generator, on purpose


@contextlib.contextmanager
def pipeline_stage_rng(step_seed: int):
    """Run a block on this pipeline stage's stream for the step: the default generators (CPU and
    the device's) seeded ``step_seed + 100 * pp_rank`` (equal on every TP and DP rank of the
    stage), then restored, so what the block draws leaves them as they were. Entering twice
    with one ``step_seed`` replays the same masks."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    cpu_state = torch.get_rng_state()
    device_state = _get_state() if _device_type() != "cpu" else None
    _seed(step_seed + _PP_SEED_OFFSET * pp_rank)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if device_state is not None:
            _set_state(device_state)


# NxD's names for the same function.
model_parallel_xla_manual_seed = model_parallel_manual_seed
model_parallel_cuda_manual_seed = model_parallel_manual_seed
