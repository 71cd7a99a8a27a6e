"""NxD's LoRA checkpoint modes: save_checkpoint of a LoRA model from the
config API follows LoraConfig.save_lora_base / merge_lora / save_lora_config_adapter, and
load_lora_from_ckpt + load_checkpoint resume it (case bodies: tests/lora_ckpt_cases.py).

tp=2 llama (all projections, lm_head in modules_to_save, bias="lora_only"): adapter only ->
plain PeftModel.from_pretrained; base and adapter -> consolidate + transformers + peft; merged ->
consolidate + transformers; each reloads through load_lora_from_ckpt with the saved logits, and
with load_checkpoint's optimizer state the next step equals the uninterrupted run."""

import pytest

import lora_ckpt_cases

_saved = {}  # tmp_dir -> what check_save_modes returned, on this rank (the pool keeps it alive)


def saved_modes(tmp_dir: str) -> dict:
    """The three checkpoints of one training run, saved once per rank process and directory."""
    if tmp_dir not in _saved:
        _saved[tmp_dir] = lora_ckpt_cases.check_save_modes(tmp_dir)
    return _saved[tmp_dir]


def save_once(tmp_dir: str) -> None:
    saved_modes(tmp_dir)


def resume(tmp_dir: str, mode: str, **kwargs) -> None:
    lora_ckpt_cases.check_resume(mode, saved_modes(tmp_dir), **kwargs)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lora_ckpt"))


def test_lora_checkpoint_save_modes_open_in_transformers_and_peft(ranks2, ckpt_dir):
    ranks2.run(save_once, ckpt_dir)


RESUMES = {
    "adapter_only": (lora_ckpt_cases.ADAPTER_ONLY, dict(lora_rank=8)),  # lora_rank ignored (the saved r=4), warned
    "base_and_adapter": (lora_ckpt_cases.BASE_AND_ADAPTER, dict(base_seed=5)),  # another base: the saved one loads
    "merged": (lora_ckpt_cases.MERGED, {}),  # the merged base is not loaded: the model's own (original) base stays
}


@pytest.mark.parametrize("mode", list(RESUMES))
def test_lora_checkpoint_resumes_through_load_lora_from_ckpt(ranks2, ckpt_dir, mode):
    tag, kwargs = RESUMES[mode]
    ranks2.run(resume, ckpt_dir, tag, **kwargs)


def test_load_lora_from_a_checkpoint_without_lora_is_refused(ranks2, tmp_path):
    ranks2.run(lora_ckpt_cases.check_bad_input, str(tmp_path))
