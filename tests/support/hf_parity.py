"""Tiny HF configs that hit the hard cases, and the parity check every architecture runs:
logits, loss and gathered gradients of the parallelized model against the unpatched model
built from the same weights."""

import torch
import transformers

import nxd_hf
from nxd_hf import backend, parallel_state, parity

TOL = dict(rtol=parity.RTOL, atol=parity.ATOL)
VOCAB = 101  # prime: never divisible by tp

# model_type -> (config class, task model class, config kwargs). Heads 6 with 2 K/V heads:
# heads % 4 != 0 (padded), kv_heads < tp (replicated); odd vocab (padded).
TINY = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(  # fused qkv_proj (GQA), gate_up_proj
        hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, dict(  # Conv1D, fused c_attn (MHA), tied head
        n_embd=48, n_inner=64, n_head=6, n_layer=2, n_positions=32, vocab_size=VOCAB, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, dict(  # per-head fused qkv, parallel residual
        hidden_size=48, intermediate_size=64, num_attention_heads=6, num_hidden_layers=2, max_position_embeddings=32,
        vocab_size=VOCAB, use_parallel_residual=True, attention_bias=True, tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(  # q/k/v biases, tied head
        hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, sliding_window=4, tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(  # per-head q/k norms, head_dim 16
        hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
        head_dim=16, vocab_size=VOCAB, tie_word_embeddings=False)),
    # derived from base_model_tp_plan (no registered patch):
    "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM, dict(  # parallel attn+MLP, logit scale
        hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, attention_bias=True, use_qk_norm=False, tie_word_embeddings=True, eos_token_id=2)),
    "phi": (transformers.PhiConfig, transformers.PhiForCausalLM, dict(  # partial rotary, dense, fc1/fc2, lm_head bias
        hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, partial_rotary_factor=0.5, tie_word_embeddings=False)),
}
DECODERS = tuple(TINY)  # the decoders above (other case modules add theirs to TINY for build_pair)

# Encoders: model_type -> (config class, default task model class, config kwargs); parallelized
# without SP, checked per task model by ``check_encoder_parity``.
ENCODER_TINY = {
    "bert": (transformers.BertConfig, transformers.BertForMaskedLM, dict(  # MHA, MLM decoder tied to embeddings
        hidden_size=48, intermediate_size=64, num_attention_heads=6, num_hidden_layers=2, max_position_embeddings=32,
        vocab_size=VOCAB, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}
ENCODER_TASKS = {
    "bert": (transformers.BertModel, transformers.BertForSequenceClassification, transformers.BertForMaskedLM),
}


def build_pair(model_type: str, seed: int = 0, *, task_model_cls=None, **overrides):
    """(reference, copy to parallelize), with identical weights and random norm weights;
    ``overrides`` change the config. The reference is on the backend's compute device (the GPU in
    the ``cuda`` lane); the copy stays on the CPU, as a model loaded the usual way: nxd_hf must move it."""
    config_cls, model_cls, kwargs = TINY[model_type] if model_type in TINY else ENCODER_TINY[model_type]
    config = config_cls(**{**kwargs, **overrides})
    reference, model = parity.build_pair(config, task_model_cls or model_cls, seed=seed, perturb="norms")
    device = backend.default_device()
    return (reference if device.type == "cpu" else reference.to(device)), model  # on CPU also under meta init


def batch(seed: int = 1, b: int = 2, s: int = 8):
    ids, labels = parity.make_batch(VOCAB, batch_size=b, seq_len=s, seed=seed)
    device = backend.default_device()  # where the model computes (the GPU in the cuda lane)
    return ids.to(device), labels.to(device)


gathered_grad = parity.gathered_grad


def check_parity(model_type: str, tp: int, sp: bool) -> None:
    """Parallelize at ``tp`` (re-initializing parallel_state) and compare with the reference."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sp)
    ids, labels = batch()
    ref_out = reference(input_ids=ids, labels=labels)
    ref_out.loss.backward()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None, "training with labels returns no logits unless gather_logits=True"
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(gathered_grad(param), ref_params[name].grad, **TOL,
                                   msg=lambda m: f"{model_type} tp={tp} sp={sp} {name}: {m}")
    reference.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **TOL)


def _encoder_loss(model, ids, mask, labels):
    """(loss, output to compare) of an encoder task model; a base model's loss is a fixed
    random projection of its hidden states plus its squared pooled output."""
    if model is model.base_model:
        out = model(input_ids=ids, attention_mask=mask)
        g = torch.Generator().manual_seed(3)
        proj = torch.randn(out.last_hidden_state.shape, generator=g)
        return (out.last_hidden_state * proj).sum() + out.pooler_output.square().sum(), out.last_hidden_state
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    return out.loss, out.logits


def check_encoder_parity(model_type: str, tp: int, model_cls) -> None:
    """``check_parity`` for an encoder task model (from ``ENCODER_TASKS``) with a padding mask;
    sequence-classification labels are class ids [b], masked-LM labels token ids or -100."""
    parallel_state.destroy_model_parallel()
    task = model_cls.__name__
    reference, model = build_pair(model_type, task_model_cls=model_cls)
    nxd_hf.parallelize(model, tensor_parallel_size=tp)
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    if "SequenceClassification" in task:
        labels = torch.tensor([2, 0])
    ref_loss, ref_out = _encoder_loss(reference, ids, mask, labels)
    loss, out = _encoder_loss(model, ids, mask, labels)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(out, ref_out, **TOL)
    ref_params = dict(reference.named_parameters())
    assert set(ref_params) == {name for name, _ in model.named_parameters()}, "ties changed the parameter set"
    for name, param in model.named_parameters():
        torch.testing.assert_close(gathered_grad(param), ref_params[name].grad, **TOL,
                                   msg=lambda m: f"{model_type} {task} tp={tp} {name}: {m}")
