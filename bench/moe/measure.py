"""One training step of a Mixtral-shaped model under expert parallelism, on every rank: the bytes
each all-to-all is handed (``backend.count_comm``, by tag), the assignments that leave the rank
(from the router's top-k), and the parameter and AdamW-state bytes this rank holds."""

import dataclasses

import torch
import transformers

from nxd_hf import backend, parallel_state


@dataclasses.dataclass(kw_only=True)
class MoEConfig:
    hidden: int = 64
    intermediate: int = 128
    experts: int = 8
    top_k: int = 2
    layers: int = 2
    heads: int = 4
    vocab: int = 101
    batch: int = 4  # rows per data-parallel rank
    seq: int = 16


TAGS = ("ep_dispatch", "ep_combine", "ep_dispatch.backward", "ep_combine.backward",
        "ep_dispatch_weights", "ep_dispatch_weights.backward", "ep_counts")


def _model(config: MoEConfig):
    torch.manual_seed(0)
    hf = transformers.MixtralConfig(
        hidden_size=config.hidden, intermediate_size=config.intermediate, num_attention_heads=config.heads,
        num_key_value_heads=config.heads, num_hidden_layers=config.layers, num_local_experts=config.experts,
        num_experts_per_tok=config.top_k, vocab_size=config.vocab, router_jitter_noise=0.0, tie_word_embeddings=False)
    return transformers.MixtralForCausalLM(hf).float()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_rank(config: MoEConfig, ep: int) -> dict:
    """This rank's figures for one step at expert_parallel_size ``ep`` (DP = world)."""
    import nxd_hf

    parallel_state.destroy_model_parallel()
    model = _model(config)
    whole = {n: p for n, p in model.named_parameters()}
    expert_names = {n for n, p in whole.items() if p.dim() == 3}
    expert_total = _bytes(p for n, p in whole.items() if n in expert_names)
    replicated = _bytes(p for n, p in whole.items() if n not in expert_names)
    nxd_hf.parallelize(model, expert_parallel_size=ep)
    ep_rank = parallel_state.get_expert_parallel_rank()
    routed = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(lambda _m, _i, out: routed.append(out[2].detach()))
    g = torch.Generator().manual_seed(1 + backend.rank())
    ids = torch.randint(0, config.vocab, (config.batch, config.seq), generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with backend.count_comm() as records:
        model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    by_tag = {tag: sum(r.payload_bytes for r in records if r.op == "all_to_all" and r.tag == tag) for tag in TAGS}
    local_experts = config.experts // ep
    leaving = sum(int(((idx // local_experts) != ep_rank).sum()) for idx in routed)
    assignments = sum(idx.numel() for idx in routed)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return dict(rank=backend.rank(), ep_rank=ep_rank, tokens=ids.numel(), assignments=assignments,
                assignments_leaving=leaving, bytes_by_tag=by_tag,
                other_collectives={f"{r.op}:{r.tag}": r.payload_bytes for r in records if r.op != "all_to_all"},
                param_bytes=_bytes(model.parameters()),
                optimizer_bytes=_bytes(state), optimizer_scalar_bytes=_bytes(v for v in state if v.dim() == 0),
                expert_total_bytes=expert_total, replicated_bytes=replicated)
