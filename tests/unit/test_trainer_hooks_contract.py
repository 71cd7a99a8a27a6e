"""The private ``transformers.Trainer`` hooks NxDTrainer overrides (``nxd_hf/trainer/hf_trainer.py``,
``hf_checkpoints.py``): each still exists on Trainer with the parameters the override takes, and
Trainer still calls it, with those arguments, from a method that ``train`` (or ``evaluate``)
reaches. A transformers upgrade that renames, re-signs or stops calling one fails here instead of
silently bypassing nxd_hf (``tests/distributed/lora/test_lora.py::test_peft_dispatch_contract`` does the
same for peft's internals)."""

import inspect
import re
import textwrap

import transformers

from nxd_hf.trainer import NxDTrainer

# hook -> (Trainer's parameters, the entry point that must reach the call, the call as Trainer writes it)
HOOKS = {
    "_wrap_model": (["self", "model", "training", "dataloader"], "train", "self._wrap_model(self.model_wrapped)"),
    "_clip_grad_norm": (["self", "model"], "train", "grad_norm = self._clip_grad_norm(model)"),
    "_get_grad_norm": (["self", "model", "grad_norm"], "train",
                       "grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)"),
    "_maybe_log_save_evaluate": (
        ["self", "tr_loss", "grad_norm", "model", "trial", "epoch", "ignore_keys_for_eval", "start_time",
         "learning_rate"], "train", "self._maybe_log_save_evaluate("),
    "_save_checkpoint": (["self", "model", "trial"], "train", "self._save_checkpoint(model, trial)"),
    "_load_from_checkpoint": (["self", "resume_from_checkpoint", "model"], "train",
                              "self._load_from_checkpoint(resume_from_checkpoint)"),
    "_load_optimizer_and_scheduler": (["self", "checkpoint"], "train",
                                      "self._load_optimizer_and_scheduler(resume_from_checkpoint)"),
    "_load_rng_state": (["self", "checkpoint"], "train", "self._load_rng_state(resume_from_checkpoint)"),
    "_save_optimizer_and_scheduler": (["self", "output_dir"], "train", "self._save_optimizer_and_scheduler(output_dir)"),
    "_save_rng_state": (["self", "output_dir"], "train", "self._save_rng_state(output_dir)"),
    "_load_best_model": (["self"], "train", "self._load_best_model()"),  # load_best_model_at_end
    # include_num_input_tokens_seen: NxDTrainer counts the global batches in get_batch_samples instead
    "_track_num_input_tokens": (["self", "inputs"], "train", "self._track_num_input_tokens(inputs)"),
    # total_flos: of the unparallelized model and the global batch (nxd_hf/trainer/flops.py)
    "floating_point_ops": (["self", "inputs"], "train", "self.current_flos += float(self.floating_point_ops(inputs))"),
    "store_flos": (["self"], "train", "self.store_flos()"),
}

# what else of Trainer's private side NxDTrainer reads or calls: (entry point, Trainer's code)
RELIED_ON = {
    "evaluation wraps the model": ("evaluate", "self._wrap_model(self.model, training=False"),
    "get_train_dataloader sizes batches by _train_batch_size": ("get_train_dataloader", "batch_size=self._train_batch_size"),
    "get_batch_samples feeds the epoch": ("train", "self.get_batch_samples(epoch_iterator, num_batches, self.args.device)"),
    "current_gradient_accumulation_steps is set per step": ("train", "self.current_gradient_accumulation_steps = len("),
    "_save_checkpoint saves the model through save_model": ("train", "self.save_model(output_dir, _internal_call=True)"),
    "_save_checkpoint records ExportableState callbacks (_record_callback_states mirrors it)": (
        "train", "self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)"),
}
RELIED_SIGNATURES = {  # Trainer methods NxDTrainer calls: their parameters
    "_prepare_inputs": ["self", "inputs"],
    "_get_output_dir": ["self", "trial"],
    "save_model": ["self", "output_dir", "_internal_call"],
}


def _method_sources(cls) -> dict[str, str]:
    return {name: textwrap.dedent(inspect.getsource(fn)) for name, fn in inspect.getmembers(cls, inspect.isfunction)}


def _reachable(sources: dict[str, str], entry: str) -> set[str]:
    """The methods ``entry`` reaches through ``self.<method>`` references (calls, or a method
    passed on, as ``find_executable_batch_size(self._inner_training_loop, ...)``)."""
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in sources:
            continue
        seen.add(name)
        todo.extend(re.findall(r"self\.(\w+)", sources[name]))
    return seen


def contract_violations(trainer_cls=transformers.Trainer, nxd_cls=NxDTrainer) -> list[str]:
    """What no longer holds, one line each (empty: the contract holds)."""
    problems = []
    sources = _method_sources(trainer_cls)

    def called(entry: str, code: str) -> bool:
        squeezed = re.sub(r"\s+", " ", code)
        return any(squeezed in re.sub(r"\s+", " ", sources[m]) for m in _reachable(sources, entry))

    for name, (params, entry, call) in HOOKS.items():
        if name not in sources:
            problems.append(f"Trainer.{name} no longer exists")
            continue
        got = list(inspect.signature(getattr(trainer_cls, name)).parameters)
        if got != params:
            problems.append(f"Trainer.{name} takes {got}, NxDTrainer's override expects {params}")
        override = inspect.signature(getattr(nxd_cls, name))
        for args, kwargs in ((range(len(params)), {}), ([0], dict.fromkeys(params[1:], 0))):
            try:
                override.bind(*args, **kwargs)
            except TypeError as error:
                problems.append(f"NxDTrainer.{name}{override} cannot take Trainer's call ({error})")
        if getattr(nxd_cls, name) is getattr(trainer_cls, name):
            problems.append(f"NxDTrainer no longer overrides Trainer.{name}")
        if not called(entry, call):
            problems.append(f"Trainer.{entry} no longer reaches `{call}`")
    for what, (entry, code) in RELIED_ON.items():
        if not called(entry, code):
            problems.append(f"{what}: Trainer.{entry} no longer reaches `{code}`")
    for name, params in RELIED_SIGNATURES.items():
        got = list(inspect.signature(getattr(trainer_cls, name)).parameters) if name in sources else None
        if got != params:
            problems.append(f"Trainer.{name} takes {got}, NxDTrainer calls it as {params}")
    for cls in nxd_cls.__mro__:  # a private method nxd_hf adds must not override one silently
        if cls.__module__.startswith("nxd_hf"):
            for name in vars(cls):
                if name.startswith("_") and not name.startswith("__") and name in sources and name not in HOOKS:
                    problems.append(f"{cls.__name__}.{name} overrides Trainer.{name}: list it in HOOKS with its contract")
    return problems


def test_trainer_hooks_nxd_trainer_overrides_keep_their_contract():
    assert contract_violations() == []


class _StopsClipping(transformers.Trainer):
    """Trainer as a release might change it: the epoch loop computes the norm itself."""

    def _run_epoch(self, model):
        grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
        grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)

    def _load_rng_state(self, checkpoint, strict=True):
        pass


class _NxDOnChanged(NxDTrainer, _StopsClipping):
    pass


def test_the_contract_catches_a_hook_trainer_stops_calling_or_re_signs():
    problems = contract_violations(_StopsClipping, _NxDOnChanged)
    assert "Trainer.train no longer reaches `grad_norm = self._clip_grad_norm(model)`" in problems
    assert not any("_get_grad_norm" in p for p in problems)  # still called as before
    assert any(p.startswith("Trainer._load_rng_state takes ['self', 'checkpoint', 'strict']") for p in problems)
