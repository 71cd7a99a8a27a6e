"""One pipeline step: microbatches and the token-normalized loss; the model's gradient policy
(``nxd_hf.parallel_layers.grad_reduction``) reduces the gradients once the step's backwards end.

Each microbatch's loss is its sum over non-ignored tokens divided by the step's count of
non-ignored tokens across all microbatches and DP replicas (times the DP size, since DP
gradients are averaged; ``loss_normalizer``), so the gradients equal those of one large batch.
``run_train(num_items_in_batch=N)`` gives that count for a step accumulated over several calls
(N summed over the calls and DP ranks); by default it is this call's count.

Each stage draws its dropout masks from its own stream, derived from one draw of the default
generator per training-mode step of a model with dropout
(``nxd_hf.parallel_layers.random.pipeline_stage_rng``); a model without dropout leaves the
default generator alone, as the unsplit model does (a random data collator then draws what it
would under ``transformers.Trainer``).
"""

import contextlib
import inspect

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules.dropout import _DropoutNd

from nxd_hf import backend, parallel_state
from nxd_hf.guards.input_check import check_step_inputs
from nxd_hf.moe import aux_loss as aux
from nxd_hf.context.attention import current_batch
from nxd_hf.pipeline.context import StepSplit
from nxd_hf.pipeline.failure import raise_on_every_rank
from nxd_hf.pipeline.pooled_loss import pooled_loss_share, row_normalizer, takes_pooled_logits
from nxd_hf.pipeline.router_aux import microbatch_masks
from nxd_hf.parallel_layers.loss_functions import loss_normalizer
from nxd_hf.parallel_layers.random import draw_step_seed, pipeline_stage_rng
from nxd_hf.parallel_layers.sharding import gather_logical


class _KeptShardGrads:
    """The gradients FSDP2 (ZeRO-2/3) has accumulated in its DP shards before this call
    (accumulation over several ``run_train`` calls). torch's schedule sets them to None whenever
    it (re)initializes a stage — on a schedule's first step, and on every switch between
    ``eval`` and ``step`` (the MoE aux pass's forwards run as ``eval``) — and FSDP2's next
    reduce-scatter then replaces them instead of adding to them: ``restore`` adds them back."""

    def __init__(self, modules):
        params = {id(p): p for m in modules for p in m.parameters()}.values()
        self.kept = [(p, p.grad) for p in params if isinstance(p, DTensor) and p.grad is not None]

    @torch.no_grad()
    def restore(self) -> None:
        for param, grad in self.kept:
            if param.grad is None:
                param.grad = grad
            elif param.grad is not grad:  # cleared, then this call's reduce-scatter made a new one
                param.grad.add_(grad)


def _select_loss(output, spec):
    """The loss in a module's output: ``spec`` marks it (NxD's output_loss_value_spec, a tuple
    or dict of bools); default the output itself or its first item."""
    if isinstance(output, torch.Tensor):
        return output
    if spec is None:
        return output[0]
    if isinstance(spec, dict):
        return next(output[k] for k, is_loss in spec.items() if is_loss)
    return next(value for value, is_loss in zip(output, spec) if is_loss)


def _check_padded_rows(padded_rows: int, labels, rows: int, *, train: bool) -> None:
    """Training may pad a whole batch (its loss is a sum over the step's tokens, so zero); an
    evaluation's loss is a mean over its own tokens, which need a row that is not padding."""
    if not padded_rows:
        return
    most = rows if train else rows - 1
    if not 0 < padded_rows <= most:
        raise ValueError(f"padded_rows={padded_rows} with a batch of {rows} rows: give 0 <= padded_rows <= {most}")
    if labels is None or bool((labels[-padded_rows:] != -100).any()):
        raise ValueError(f"the last padded_rows={padded_rows} rows must have labels -100 (ignored by the loss): "
                         "set their labels to -100, or pass padded_rows=0")


def _dropout_probabilities(config) -> list[float]:
    values = config.to_dict() if config is not None else {}
    found = []
    while values:
        key, value = values.popitem()
        if isinstance(value, dict):  # a sub-config (text_config, ...)
            values.update({f"{key}.{k}": v for k, v in value.items()})
        elif isinstance(value, float) and ("dropout" in key or key.endswith("_pdrop")):
            found.append(value)
    return found


def has_dropout(modules, config) -> bool:
    """Whether ``modules`` hold a dropout module of p > 0, or ``config`` a dropout probability
    > 0 (HF attention applies it as a function)."""
    in_modules = any(isinstance(m, _DropoutNd) and m.p > 0 for module in modules for m in module.modules())
    return in_modules or any(p > 0 for p in _dropout_probabilities(config))


class StepRunner:
    """Runs ``run_train``/``run_eval`` for an ``NxDPPModel``; schedules cached per input shape."""

    def __init__(self, pp_model):
        self.model = pp_model
        self.schedules = {}
        self.num_items = None
        self.train = True
        self._dropout = None  # whether some stage has dropout: agreed over the pipeline on the first step
        # sequence classification: the graph ends in pooled logits [b, num_labels], the loss counts rows
        self.pooled = pp_model.is_hf and takes_pooled_logits(pp_model.hf_model)
        self.split = StepSplit(pp_model.hf_model, pp_model.num_microbatches) if pp_model.cp_size > 1 else None
        self._config_taker = (None, False)  # (loss_function, whether it takes the config), read once per function

    def _stage_rng(self):
        """A context for each pass of the step: this stage's stream (one draw of the default
        generator, so one seed for every pass), or nothing when no stage draws."""
        if self._dropout is None:
            group = parallel_state.get_pipeline_model_parallel_group()
            local = has_dropout(self.model.local_modules(), self.model.config)
            flag = torch.tensor([float(local)], device=backend.collective_device(group))
            self._dropout = bool(backend.all_reduce(flag, group, op="max").item())
        # the stages' mode: NxDModel (NxDTrainer) sets it on them, not on the NxDPPModel
        if not (self._dropout and any(stage.training for stage in self.model.local_modules())):
            return contextlib.nullcontext
        step_seed = draw_step_seed()
        return lambda: pipeline_stage_rng(step_seed)

    def _loss_fn(self, output, labels):
        original = self.model.hf_model
        if self.pooled:
            return pooled_loss_share(original, output, labels, self.num_items)
        if self.model.is_hf:  # the model's own loss (vocab-parallel under TP) on the logits
            extra = {} if self.split is None else {"shift_labels": labels}  # CP shifted them before the split
            loss_function = original.loss_function
            if self._config_taker[0] is not loss_function:  # trainers may install theirs after the setup
                self._config_taker = (loss_function, "config" in inspect.signature(loss_function).parameters)
            if self._config_taker[1]:  # HF's token classification reads num_labels
                extra["config"] = original.config
            return loss_function(logits=output, labels=labels, vocab_size=original.config.vocab_size,
                                 num_items_in_batch=self.num_items, **extra)
        # a plain module returns its loss (picked by output_loss_value_spec), a microbatch mean
        return _select_loss(output, self.model.output_loss_value_spec) / self.model.num_microbatches

    def _schedule(self, args: list[torch.Tensor], train: bool):
        # training and evaluation keep their own schedules: DPO's reference pass under LoRA
        # (run_eval, then run_train at the same shape, every step) left a training step without
        # the gradient of a stage's input on a shared one (nxd_hf.integrations.dpo_pipeline)
        signature = (train, *((tuple(a.shape), a.dtype) for a in args))
        if signature not in self.schedules:
            microbatch = [a.chunk(self.model.num_microbatches)[0] for a in args]
            self.schedules[signature] = self.model.build_schedule(self._loss_fn, microbatch, train=train)
        return self.schedules[signature]

    def _check(self, inputs: dict) -> None:
        unknown = set(inputs) - set(self.model.input_names)
        first = self.model.input_names[0]
        if unknown or first not in inputs:
            raise ValueError(f"run_train/run_eval take the input_names {self.model.input_names}; got {sorted(inputs)}")
        batch = inputs[first].shape[0]
        if batch % self.model.num_microbatches:
            fits = [m for m in range(1, batch + 1) if batch % m == 0]
            raise ValueError(f"a batch of {batch} does not split into num_microbatches={self.model.num_microbatches}; "
                             f"use a batch that is a multiple of it, or num_microbatches in {fits}")

    def run(self, inputs: dict, *, train: bool, return_logits: bool = False, padded_rows: int = 0):
        inputs = dict(inputs)
        step_count = inputs.pop("num_items_in_batch", None)
        check_step_inputs(self.model.nxd.input_check, inputs)  # before any check one rank alone could fail
        self._check(inputs)
        model = self.model
        labels = inputs.get("labels")
        if labels is None and model.is_hf:
            raise ValueError(f"run_train/run_eval need labels to compute the loss; got only {sorted(inputs)}: pass "
                             "labels=... (the input_ids, shifted inside the model, for a causal LM)")
        missing = [name for name in model.input_names if name not in inputs]
        if missing and not model.is_hf:  # every name is an input of the traced graph
            raise ValueError(
                f"run_train/run_eval got no {missing}: a model that is not Hugging Face's takes every name of "
                f"input_names {model.input_names}, its loss coming out of its forward (output_loss_value_spec "
                "picks it). Pass them all, or set input_names to the inputs its forward uses")
        _check_padded_rows(padded_rows, labels, inputs[model.input_names[0]].shape[0], train=train)
        if not model.is_hf:  # the loss is in the traced graph; the schedule still wants a target
            labels = torch.zeros(inputs[model.input_names[0]].shape[0], device=backend.default_device())
        if model.is_hf and "attention_mask" in model.input_names and "attention_mask" not in inputs:
            inputs = {**inputs, "attention_mask": torch.ones_like(inputs["input_ids"])}
        normalizer = row_normalizer if self.pooled else loss_normalizer
        self.num_items = normalizer(labels, step_count) if model.is_hf else None
        if self.split is not None:  # this CP rank's chunks of the sequence (nxd_hf.pipeline.context)
            inputs, labels = self.split(inputs)
            # HF builds no mask for CP attention; the router loss counts the tokens this one keeps
            ids = inputs["input_ids"]
            inputs["attention_mask"] = current_batch().token_mask(ids.shape[0]).to(ids.dtype)
        names = [name for name in model.input_names if name != "labels" or not model.is_hf]
        first, last = 0 in model.local_stage_ids, model.num_stages - 1 in model.local_stage_ids
        losses = [] if last else None
        step_args = [inputs[name] for name in names if name not in model.keyword_inputs] if first else []
        step_kwargs = {name: inputs[name] for name in model.keyword_inputs}  # to every stage
        if last:
            step_kwargs.update(target=labels, losses=losses)
        router_aux, aux_value = model.router_aux, None
        stage_rng = self._stage_rng()  # the aux pass and the step draw the same dropout masks
        kept = _KeptShardGrads(model.local_modules())
        if train:
            model.tied.begin_step()
        try:  # no agreement per microbatch: a failure aborts the groups, which its peers notice at once
            schedule = self._schedule([inputs[name] for name in names], train)  # keyword inputs last, as traced
            if router_aux is not None:
                with stage_rng():
                    aux_value = self._router_aux_pass(schedule, inputs, step_args, step_kwargs, last, train,
                                                      padded_rows)
            if train:
                with stage_rng(), model.nxd.grad_reduction.one_backward():
                    schedule.step(*step_args, return_outputs=False, **step_kwargs)
                    kept.restore()  # before the reductions: the ties sum this step's part
            else:
                with stage_rng():
                    outputs = schedule.eval(*step_args, return_outputs=return_logits, **step_kwargs)
                kept.restore()
            if router_aux is not None and not train:
                aux_value = self._router_aux_value()
        except Exception as error:
            raise_on_every_rank("run_train" if train else "run_eval", error)
        finally:
            if router_aux is not None:
                router_aux.end()
        if aux_value is not None and losses is not None:  # HF's loss: the token loss plus coef * aux
            losses = [l + aux_value.to(l.device) / len(losses) for l in losses]
        loss = self._reduce_losses(losses)
        if return_logits:
            logits = self._logits_everywhere(outputs if last else None, inputs[model.input_names[0]].shape)
            if self.split is not None:  # the whole sequence's, in order
                logits = current_batch().gather(logits, parallel_state.get_context_parallel_group())
            return loss, logits
        return loss

    def _router_aux_pass(self, schedule, inputs: dict, step_args, step_kwargs, last: bool, train: bool,
                         padded_rows: int = 0):
        """Before a training step: the forwards alone, collecting the routers' partial sums, then
        the routers set to add their surrogate losses (``nxd_hf.pipeline.router_aux``); returns
        ``coef * aux``. Before an evaluation: collection during the evaluation itself (None)."""
        router_aux, model = self.model.router_aux, self.model
        masks = microbatch_masks(inputs, model.num_microbatches, padded_rows)
        router_aux.begin("collect", masks)
        if not train:
            return None
        with torch.no_grad():
            kwargs = {**step_kwargs, "losses": []} if last else step_kwargs
            schedule.eval(*step_args, return_outputs=False, **kwargs)
        value = self._router_aux_value()
        spec = router_aux.spec
        weights = aux.gradient_weights(router_aux.stats, spec.num_experts, spec.coef)
        # gradients are averaged over DP: each replica's share of the surrogate counts dp times
        router_aux.begin("attach", masks, weights * parallel_state.get_data_parallel_size())
        return value

    def _router_aux_value(self) -> torch.Tensor:
        router_aux = self.model.router_aux
        stats = router_aux.complete_statistics()
        return router_aux.spec.coef * aux.aux_loss(stats, router_aux.spec.num_experts)

    def _last_stage_rank(self) -> int:
        pipelines = parallel_state.get_pipeline_model_parallel_group(as_list=True)
        return next(ranks for ranks in pipelines if backend.rank() in ranks)[self.model.stage_to_rank[-1]]

    def _logits_everywhere(self, logits, batch_shape) -> torch.Tensor:
        """The last stage's logits, gathered over TP, unpadded and in fp32, on every PP rank."""
        group = parallel_state.get_pipeline_model_parallel_group()
        if self.pooled:  # [b, num_labels], replicated over TP
            shape, logits = (batch_shape[0], self.model.config.num_labels), None if logits is None else logits.float()
        else:
            shape = (*batch_shape, self.model.config.vocab_size)
            logits = None if logits is None else gather_logical(logits, None, shape[-1]).float()
        if logits is not None:
            logits = logits.contiguous()  # gloo sends storage
        else:
            logits = torch.empty(*shape, device=backend.collective_device(group))
        return backend.broadcast(logits, self._last_stage_rank(), group)

    def _reduce_losses(self, losses):
        model = self.model
        device = backend.collective_device(parallel_state.get_pipeline_model_parallel_group())
        if losses is not None:
            mb_losses = torch.stack([l.detach().float() for l in losses])
        else:
            mb_losses = torch.zeros(model.num_microbatches, device=device)
        if model.return_mb_loss:
            return list(mb_losses) if losses is not None else None
        loss = mb_losses.sum()
        if not model.broadcast_and_average_loss:
            return loss if losses is not None else None
        backend.broadcast(loss, self._last_stage_rank(), parallel_state.get_pipeline_model_parallel_group())
        backend.all_reduce(loss, parallel_state.get_data_parallel_group())
        return loss / parallel_state.get_data_parallel_size()
