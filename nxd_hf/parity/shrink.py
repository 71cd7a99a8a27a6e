"""Shrink a Hugging Face config to a model that builds and runs in a second on CPU while keeping
what matters to tensor parallelism: the query/K-V head ratio, one decoder layer of each kind
(sliding and global attention, dense and sparse MLP, linear and full attention, ...), biases,
ties and every architecture flag. Sizes become small: head_dim 8, a few heads, vocab 101
(prime, so never divisible by tp), a few experts (at least 4, twice the top-k, which is kept)."""

VOCAB = 101
HEAD_DIM = 8
MAX_LAYERS = 6

# Per-layer lists that hold layer indices, not one value per layer.
_INDEX_LISTS = {"moe_layers", "mlp_only_layers", "ple_layer_ids"}
# Integer options counting leading/trailing layers of one kind: clamped to one layer.
_LAYER_COUNTS = {"first_k_dense_replace", "num_dense_layers", "num_kv_shared_layers", "moe_layer_start_index"}
_EXPERT_COUNTS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "n_experts"}
_EXPERTS_PER_TOKEN = {"num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k"}
_TOKEN_IDS = {"bos_token_id", "eos_token_id", "pad_token_id"}


def shrink_config(config, *, num_layers: int | None = None, overrides: dict | None = None):
    """A small copy of ``config`` (see module doc). ``num_layers`` forces the layer count
    (the per-layer lists then repeat the chosen layer kinds); ``overrides`` are set last."""
    values = config.to_dict()
    num_heads, num_kv_heads = _head_counts(values)
    small = {key: _shrink_value(key, value, values, num_heads, num_kv_heads) for key, value in values.items()}
    _shrink_layers(small, values, num_layers)
    small.pop("transformers_version", None)
    small.update(overrides or {})
    return type(config)(**small)  # derived attributes (head_dim, layer_types, ...) recomputed


def _head_counts(values: dict) -> tuple[int, int]:
    """Small (num_heads, num_kv_heads) with the original ratio: 2 K/V heads (1 for MQA) and
    6 heads for multi-head attention (not divisible by 4: padded at tp=4)."""
    heads = values.get("num_attention_heads") or 4
    kv_heads = values.get("num_key_value_heads") or heads
    if kv_heads == heads:
        return 6, 6
    group = heads // kv_heads
    small_kv = 1 if kv_heads == 1 else 2
    return small_kv * group, small_kv


def _shrink_value(key: str, value, values: dict, num_heads: int, num_kv_heads: int):
    if value is None:
        return _fill_missing(key, num_kv_heads)
    if key == "per_layer_config":
        return value  # remapped with the layers
    if isinstance(value, dict) and key.endswith("_config") and "hidden_size" in value:
        return _shrink_sub_config(value)  # a vision or audio tower of a multimodal model
    if key == "mamba_d_head":  # mamba heads x head size = expand x hidden
        return values.get("mamba_expand", 2) * num_heads * HEAD_DIM // _shrink_size(
            "mamba_n_heads", values["mamba_n_heads"], values, num_heads)
    if key.endswith("_layer_period"):
        return 2
    if key.endswith("_layer_offset"):
        return 1
    if key == "num_layers_per_stack":
        return None  # recomputed from num_hidden_layers (hrm_text)
    if isinstance(value, bool) or not isinstance(value, (int, float, list)):
        return value
    if key in ("num_attention_heads", "n_head"):
        return num_heads
    if key == "num_key_value_heads":
        return num_kv_heads
    if key in ("hidden_size", "n_embd"):
        return num_heads * HEAD_DIM
    if key in ("vocab_size", "vocab_size_per_layer_input"):
        return VOCAB
    if key in _TOKEN_IDS:
        return [i % VOCAB for i in value] if isinstance(value, list) else (value % VOCAB if value is not None else None)
    if isinstance(value, float):
        return 0.0 if "dropout" in key or key.endswith("_pdrop") else value
    if key in _EXPERT_COUNTS and isinstance(value, int):
        return min(value, _experts_kept(values))
    if key in _EXPERTS_PER_TOKEN and isinstance(value, int):
        return value  # top-k kept: the routing (and its aux loss) is the model's
    if key in ("n_group", "num_expert_group", "topk_group"):
        return 1
    return _shrink_size(key, value, values, num_heads)


def _experts_kept(values: dict) -> int:
    """At least 4 experts (expert parallelism up to 4) and twice the top-k, a multiple of 4."""
    top_k = max([v for k, v in values.items() if k in _EXPERTS_PER_TOKEN and isinstance(v, int)] or [2])
    return max(4, -(-2 * top_k // 4) * 4)


def _shrink_sub_config(values: dict) -> dict:
    num_heads, num_kv_heads = _head_counts(values)
    small = {key: _shrink_value(key, value, values, num_heads, num_kv_heads) for key, value in values.items()}
    for key in ("num_hidden_layers", "num_blocks", "depth"):
        if isinstance(small.get(key), int):
            small[key] = 1
    return small


def _fill_missing(key: str, num_kv_heads: int):
    """Sizes some configs leave None for the model to fail on (their defaults do not build)."""
    if key == "head_dim":
        return HEAD_DIM
    if key == "num_key_value_heads":
        return num_kv_heads
    if key in _EXPERT_COUNTS:
        return 4
    if key in _EXPERTS_PER_TOKEN:
        return 2
    return None


def _shrink_size(key: str, value, values: dict, num_heads: int):
    """Hidden sizes of sub-layers: intermediate sizes, head dims, low ranks, other head counts."""
    if isinstance(value, list):
        if "intermediate_size" in key and all(isinstance(v, int) for v in value):
            return [min(v, 64) for v in value]
        return value
    if "intermediate_size" in key or key in ("ffn_hidden_size", "expert_ffn_hidden_size", "n_inner"):
        return min(value, 64)
    if key in ("qk_head_dim", "swa_head_dim"):  # qk_nope_head_dim + qk_rope_head_dim
        return 2 * HEAD_DIM
    if key.endswith("head_dim"):
        return min(value, HEAD_DIM)
    if key.endswith("lora_rank") or key in ("hc_lowrank", "laurel_rank", "hidden_size_per_layer_input", "ple_embed_dim"):
        return min(value, 16)
    if key in ("rotary_dim",):
        return min(value, HEAD_DIM // 2)
    if key.endswith("_heads") and key.startswith(("linear_num", "index_n", "mamba_n", "swa_num", "linear_", "mamba_")):
        original = values.get("num_attention_heads") or num_heads
        return max(1, value * num_heads // original)
    if key in ("max_position_embeddings", "n_positions") and value > 256:
        return 256
    if key in ("sliding_window", "sliding_window_size", "attention_chunk_size") and value > 4:
        return 4  # shorter than the test sequences, so the window matters
    return value


def _per_layer_lists(values: dict, count: int) -> dict[str, list]:
    return {k: v for k, v in values.items() if isinstance(v, list) and len(v) == count and k not in _INDEX_LISTS}


def _shrink_layers(small: dict, values: dict, num_layers: int | None) -> None:
    """Keep the first layer of each kind (a kind: its values in every per-layer list)."""
    count_key = "num_hidden_layers" if "num_hidden_layers" in values else "num_layers" if "num_layers" in values else None
    if count_key is None:
        return
    count = values[count_key]
    lists = _per_layer_lists(values, count)
    per_layer = {int(k): v for k, v in (values.get("per_layer_config") or {}).items()}
    kinds = {}
    for i in range(count):
        kinds.setdefault((*(repr(lists[k][i]) for k in sorted(lists)), repr(per_layer.get(i))), i)
    chosen = sorted(kinds.values())[:MAX_LAYERS]
    while len(chosen) < max(2, num_layers or 0):
        chosen.append(chosen[len(chosen) % len(kinds)] if len(kinds) > 1 else chosen[-1] + 1)
    chosen = chosen[: num_layers or len(chosen)]
    small[count_key] = len(chosen)
    for key, full in lists.items():
        small[key] = [full[i] for i in chosen]
    for key in _INDEX_LISTS & values.keys():
        if isinstance(values[key], list):
            small[key] = [new for new, old in enumerate(chosen) if old in values[key]]
    if isinstance(values.get("per_layer_config"), dict):  # heterogeneous layers (gemma4): keep the chosen ones
        small["per_layer_config"] = _per_layer_config(values, chosen)
    for key in _LAYER_COUNTS & values.keys():
        if isinstance(values[key], int) and values[key] > 0:
            small[key] = 1


def _per_layer_config(values: dict, chosen: list[int]) -> dict:
    """transformers' heterogeneous ``per_layer_config`` ({layer index: overrides}) for the chosen
    layers, with their overrides shrunk like the config."""
    num_heads, num_kv_heads = _head_counts(values)
    overrides = {int(k): v for k, v in values["per_layer_config"].items()}
    return {new: {k: _shrink_override(k, v, values, num_heads, num_kv_heads) for k, v in overrides[old].items()}
            for new, old in enumerate(chosen) if old in overrides}


def _shrink_override(key: str, value, values: dict, num_heads: int, num_kv_heads: int):
    """A per-layer size keeps its ratio to the config-wide one (a global layer's head_dim twice
    the sliding layers' stays twice)."""
    base = values.get(key)
    if key == "head_dim" and value == (values.get("qk_nope_head_dim") or 0) + (values.get("qk_rope_head_dim") or -1):
        return 2 * HEAD_DIM  # an MLA-style layer's head: qk_nope_head_dim + qk_rope_head_dim
    if key in ("head_dim", "num_attention_heads", "num_key_value_heads") and isinstance(value, int) and base:
        small = _shrink_value(key, base, values, num_heads, num_kv_heads)
        return max(1, small * value // base)
    return _shrink_value(key, value, values, num_heads, num_kv_heads)
