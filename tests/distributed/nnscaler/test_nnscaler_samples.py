"""Every code sample of nnscaler-parallel-module.md (in ``shared/reference/`` beside the checkout)
runs as its own test, adapted only by the import (``nnscaler`` -> ``nxd_hf.nnscaler``) and tiny
sizes; the optimizer, state-dict and broadcast samples run on ParallelModules in
test_nnscaler_state.py instead (one world for all of them)."""

import pytest
import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.nnscaler import ComputeConfig, non_parallel_module_reducer, parallelize
from support.nnscaler import compare_logical, lm_loss, token_batch
from support.nnscaler_models import Branchy, LLM, MLP, TOL


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
    x, y = token_batch(5)
    loss, ref_loss = lm_loss(model(x), y), lm_loss(ref(x), y)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward(), ref_loss.backward()
    non_parallel_module_reducer(model).sync_grads()
    compare_logical(model, ref)


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


def sample_train_step(tmp):
    """Lines 391 and 415: ``train_step(samples, is_dummy_batch, scale_fn)`` and ``infer_step``, as the
    document writes them; they train as one process in test_nnscaler_core.py::test_end2end_mlp_tp2."""
    import inspect

    from nxd_hf.nnscaler import ParallelModule

    assert list(inspect.signature(ParallelModule.train_step).parameters) == [
        "self", "samples", "is_dummy_batch", "scale_fn"]
    assert list(inspect.signature(ParallelModule.infer_step).parameters) == ["self", "samples"]


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


NNSCALER = {  # nnscaler-parallel-module.md, by the line its code block starts on:
    # (what it shows, the case below running it or the test of another file that runs it, ranks)
    19: ("Example 1: parallelize(LLM, ...) of a whole module class with ComputeConfig",
         "sample_parallelize_module_class", 2),
    49: ("Example 2: parallelize of a submodule inside a plain module", "sample_parallelize_submodule", 2),
    91: ("infer / train with build_optimizer", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    116: ("Example 3: End2EndMLP with dict samples, pipelined", "test_nnscaler_core.py::test_example3_end2end_mlp_pp2", 2),
    154: ("infer_step / train_step with build_optimizer", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    177: ("BroadcastGenFilesStrategy values", "test_nnscaler_state.py::test_gen_savedir_reuse_and_broadcast", 2),
    222: ("broadcast_weights(parallel_module, plan_ngpus) with broadcast_strategy='no_weights'", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    243: ("parallelize(...) signature", "sample_parallelize_signature", 2),
    319: ("build_optimizer(...) signature", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    368: ("register_reducer_pre_hook / post_hook", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    381: ("ParallelModule.__init__(init_params=True)", "test_nnscaler_core.py::test_training_flag_and_class_path", 2),
    391: ("ParallelModule.train_step(samples, is_dummy_batch, scale_fn)", "sample_train_step", 2),
    415: ("ParallelModule.infer_step(samples)", "sample_train_step", 2),
    439: ("merge_state_dicts", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    459: ("load_merged_state_dicts", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    478: ("deduped_state_dict", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    487: ("load_deduped_state_dict", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    505: ("dataset sampling per unit (DistributedSampler)", "sample_distributed_sampler", 4),
}


def _elsewhere(case: str) -> bool:
    return "::" in case


def test_the_samples_run_by_other_tests_name_tests_that_exist():
    """The optimizer, state-dict and broadcast samples run on ParallelModules in test_nnscaler_state.py
    (one world for all of them), not here: one integrity check of that mapping, so a renamed test
    cannot leave a sample unrun (it is not a run of the samples, which those tests are)."""
    import importlib

    missing = []
    for line, (_, case, _) in NNSCALER.items():
        if _elsewhere(case):
            file, test = case.split("::")
            if not callable(getattr(importlib.import_module(file.removesuffix(".py")), test, None)):
                missing.append((line, case))
    assert not missing, missing


@pytest.mark.parametrize("line", sorted(line for line, (_, case, n) in NNSCALER.items() if not _elsewhere(case) and n == 2))
def test_nnscaler_sample_world2(ranks2, tmp_path, line):
    ranks2.run(globals()[NNSCALER[line][1]], str(tmp_path))


@pytest.mark.parametrize("line", sorted(line for line, (_, case, n) in NNSCALER.items() if not _elsewhere(case) and n == 4))
def test_nnscaler_sample_world4(ranks4, tmp_path, line):
    ranks4.run(globals()[NNSCALER[line][1]], str(tmp_path))
