"""The model, batch and hand-split pipeline of ``bench/pipeline/run.py``: a Llama-shaped HF model
split by hand into stage modules, the ceiling an automatic partitioner is measured against."""

import torch
import torch.distributed as dist
from torch import nn

from nxd_hf.pipeline.partition import local_stages
from nxd_hf.pipeline.runtime import SCHEDULES, build_schedule

MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=1024, tie_word_embeddings=False)
SEQ, MICROBATCH = 128, 1  # tokens per sequence, sequences per microbatch


def build_model():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))


def make_batch(num_microbatches: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (num_microbatches * MICROBATCH, SEQ), generator=g)
    return ids, ids.clone()  # HF shifts the labels


class HandStage(nn.Module):
    """Layers ``layer_ids`` of a Llama model, with the embedding on the first stage and norm +
    lm_head on the last; RoPE from the positions, causal attention without a mask tensor."""

    def __init__(self, model, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[i] for i in layer_ids)
        self.rotary_emb = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x):
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=position_ids,
                           position_embeddings=position_embeddings)
        return self.lm_head(self.norm(hidden)) if self.lm_head is not None else hidden


def build_hand(name: str, pp_size: int, num_microbatches: int, virtual: int, labels):
    """(step function, local stages, schedule, local parameters) of the hand-split pipeline."""
    _, placement, multi = SCHEDULES[name]
    model = build_model()
    num_stages, num_layers = pp_size * virtual, MODEL["num_hidden_layers"]
    per_stage = num_layers // num_stages
    hidden = torch.empty(MICROBATCH, SEQ, MODEL["hidden_size"], device="meta", requires_grad=True)
    ids = torch.empty(MICROBATCH, SEQ, dtype=torch.long, device="meta")
    logits = torch.empty(MICROBATCH, SEQ, MODEL["vocab_size"], device="meta", requires_grad=True)
    modules, metadata = {}, {}
    for s in local_stages(num_stages, pp_size, dist.get_rank(), placement):
        first, last = s == 0, s == num_stages - 1
        modules[s] = HandStage(model, list(range(s * per_stage, (s + 1) * per_stage)), first, last)
        metadata[s] = ((ids if first else hidden,), (logits if last else hidden,))
    count = (labels[..., 1:] != -100).sum().to(torch.float32)

    def loss_fn(output, target):
        return model.loss_function(logits=output, labels=target, vocab_size=MODEL["vocab_size"],
                                   num_items_in_batch=count)

    # the same runtime as ours (torch's stages and schedules, plus nxd_hf's first-stage I/W split)
    schedule = build_schedule(name, modules, num_stages, device=torch.device("cpu"), group=None,
                              num_microbatches=num_microbatches, loss_fn=loss_fn, deallocate_outputs=False,
                              stage_metadata=metadata, layer_types=(type(model.model.layers[0]),))
    stages = schedule._stages if multi else [schedule._stage]
    has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def step(ids):
        """The step's loss on the rank holding the last stage, None elsewhere (like ``run_train``)."""
        losses = [] if has_last else None
        schedule.step(*([ids] if has_first else []), **(dict(target=labels, losses=losses) if has_last else {}))
        return torch.stack(losses).sum() if has_last else None

    params = [p for stage in stages for p in stage.submod.parameters()]
    return step, stages, schedule, params

