"""nnscaler-parallel-module.md's code samples as cases (``tests/distributed/test_reference_samples.py``),
adapted only by the import (``nnscaler`` -> ``nxd_hf.nnscaler``) and tiny sizes."""

import torch
from torch import nn

from nnscaler_cases import _compare, _lm_loss, _tokens, end2end_matches, training_flag_and_class_path
from nnscaler_models import LLM, MLP, TOL, Branchy
from nxd_hf import parallel_state
from nxd_hf.nnscaler import ComputeConfig, non_parallel_module_reducer, parallelize


def sample_parallelize_module_class(tmp):
    """Line 19 (Example 1): ``parallelize(LLM, {'x': llm_sample_input}, pas_policy, compute_config)``
    gives a class; its instance infers like the plain LLM."""
    torch.manual_seed(0)  # the ranks of a unit take the same input
    llm_sample_input = torch.randint(0, 32, (2, 8))
    pas_policy = "tp"
    compute_config = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_zero=False)
    ParallelizedLLM = parallelize(LLM, {"x": llm_sample_input}, pas_policy, compute_config, gen_savedir=tmp)
    model, ref = ParallelizedLLM(), LLM()

    def infer(model, x):
        model.eval()
        with torch.inference_mode():
            return model(x)

    torch.testing.assert_close(infer(model, llm_sample_input), infer(ref, llm_sample_input), **TOL)


class HeavyModule(MLP):
    pass


class SubmoduleLLM(nn.Module):
    """Line 49 (Example 2): ``__init__`` parallelizes a submodule; the rest stays plain."""

    def __init__(self, tmp=None):
        super().__init__()
        torch.manual_seed(1)
        self.embed, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        heavy = HeavyModule()
        if tmp is not None:
            heavy_module_sample_input = torch.randn(2, 8, 16)
            compute_config = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_zero=False)
            heavy = parallelize(heavy, {"x": heavy_module_sample_input}, "tp", compute_config, gen_savedir=tmp)
        self.heavy_module = heavy

    def forward(self, x):
        return self.head(self.heavy_module(self.embed(x)))


def sample_parallelize_submodule(tmp):
    model, ref = SubmoduleLLM(tmp), SubmoduleLLM()
    x, y = _tokens(5)
    loss, ref_loss = _lm_loss(model(x), y), _lm_loss(ref(x), y)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward(), ref_loss.backward()
    non_parallel_module_reducer(model).sync_grads()
    _compare(model, ref)


def sample_end2end_pipelined(tmp):
    """Line 116 (Example 3): the End2EndMLP with dict samples, pipelined, train_step/infer_step."""
    end2end_matches(tmp, "mlp", "pp", 2, 2, steps=2)


def sample_parallelize_signature(tmp):
    """Line 243: ``parallelize``'s parameters, in order, with the document's defaults."""
    import inspect

    params = inspect.signature(parallelize).parameters
    assert list(params) == ["module_or_module_class", "dummy_forward_args", "pas_policy", "compute_config",
                            "gen_savedir", "reuse", "instance_name", "load_module", "module_dtype", "module_fn",
                            "init_module_params", "broadcast_strategy"]
    defaults = {k: p.default for k, p in params.items() if p.default is not p.empty}
    assert str(defaults.pop("reuse")).lower().endswith("match")
    assert defaults == {"gen_savedir": "./.nnscaler", "instance_name": None, "load_module": True,
                        "module_dtype": None, "module_fn": None, "init_module_params": True,
                        "broadcast_strategy": "none"}


def sample_init_params(tmp):
    """Line 381: ``ParallelModule.__init__(init_params=True)``."""
    training_flag_and_class_path(tmp)


def sample_train_step(tmp):
    """Lines 391 and 415: ``train_step(samples, is_dummy_batch, scale_fn)`` and ``infer_step``."""
    import inspect

    from nxd_hf.nnscaler import ParallelModule

    assert list(inspect.signature(ParallelModule.train_step).parameters) == [
        "self", "samples", "is_dummy_batch", "scale_fn"]
    assert list(inspect.signature(ParallelModule.infer_step).parameters) == ["self", "samples"]
    end2end_matches(tmp, "mlp", "tp", 2, 2, steps=3)


def sample_distributed_sampler(tmp):
    """Line 505: the sampler over units (``rank // plan_ngpus`` of ``runtime // plan`` replicas)
    feeds the ranks of a unit the same batch: nxd_hf's data-parallel rank is that unit index."""
    import torch.distributed as dist

    compute_config = ComputeConfig(2, 4)
    parallelize(Branchy(), {"x": torch.randn(2, 8)}, "tp", compute_config, gen_savedir=tmp)
    dataset = list(range(16))
    sampler = torch.utils.data.DistributedSampler(
        dataset=dataset, num_replicas=compute_config.runtime_ngpus // compute_config.plan_ngpus,
        rank=dist.get_rank() // compute_config.plan_ngpus, shuffle=False)
    assert dist.get_rank() // compute_config.plan_ngpus == parallel_state.get_data_parallel_rank()
    mine = list(sampler)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    tp_peers = parallel_state.get_tensor_model_parallel_group(as_list=True)
    for group in tp_peers:
        assert all(everyone[r] == everyone[group[0]] for r in group)
    assert everyone[0] != everyone[2]
