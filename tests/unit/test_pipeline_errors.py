"""Bad pipeline requests are ValueErrors that say what would work (no processes)."""

import types

import pytest
import torch

from nxd_hf.pipeline.runtime import check_schedule
from nxd_hf.pipeline.step import StepRunner


@pytest.mark.parametrize("name,pp,v,m,message", [
    ("interleaved_1f1b", 2, 2, 3, "multiple of the pipeline parallel size"),
    ("interleaved_zero_bubble", 4, 2, 6, "num_microbatches=4"),
    ("zbv", 2, 3, 4, "virtual_pipeline_size=2"),
    ("1f1b", 2, 2, 4, "one stage per rank"),
    ("interleaved_1f1b", 2, 1, 4, "virtual_pipeline_size >= 2"),
    ("fastest", 2, 1, 4, "unknown pipeline schedule"),
])
def test_impossible_schedules(name, pp, v, m, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(name, pp, v, m)


def test_valid_schedules_pass():
    check_schedule("1f1b", 2, 1, 3)
    check_schedule("interleaved_1f1b", 2, 2, 4)
    check_schedule("zbv", 2, 2, 2)


def _runner(num_microbatches=4):
    model = types.SimpleNamespace(num_microbatches=num_microbatches, input_names=["input_ids", "attention_mask", "labels"],
                                  is_hf=False, cp_size=1)
    return StepRunner(model)


def test_batch_not_divisible_by_microbatches():
    with pytest.raises(ValueError, match=r"num_microbatches in \[1, 2, 3, 6\]"):
        _runner(4)._check({"input_ids": torch.zeros(6, 8, dtype=torch.long)})


def test_unknown_inputs_are_named():
    with pytest.raises(ValueError, match="input_names"):
        _runner()._check({"input_ids": torch.zeros(4, 8, dtype=torch.long), "pixel_values": torch.zeros(1)})


def test_microbatch_and_bucket_sizes_must_be_positive():
    from support import hf_parity
    import nxd_hf
    from nxd_hf.pipeline import NxDPPModel

    _, model = hf_parity.build_pair("llama")
    with pytest.raises(ValueError, match="num_microbatches"):
        NxDPPModel(model, num_microbatches=0)
    with pytest.raises(ValueError, match="bucket_size_mb"):
        nxd_hf.parallelize(model, bucket_size_mb=0)


def test_none_at_a_stage_boundary_is_not_sent():
    """A stage of a module that is not HF's whose boundary values are None for one input
    signature (a mask built only when given): they are dropped from the sends and re-inserted as
    None on the receiving stage; one that is None on some batches only is refused by name."""
    from nxd_hf.pipeline.stages import NoneAtBoundary

    def stage(a, mask, b):
        assert mask is None
        return a + b, None, a * b

    wrapped = NoneAtBoundary(stage, none_in=[1], none_out=[1])
    a, b = torch.ones(2), torch.full((2,), 3.0)
    assert [t.tolist() for t in wrapped(a, b)] == [[4.0, 4.0], [3.0, 3.0]]
    with pytest.raises(ValueError, match="None on some batches of one shape and a tensor on others"):
        NoneAtBoundary(lambda a, b: (a, b), none_in=[], none_out=[1])(a, b)
