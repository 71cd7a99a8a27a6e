"""The random ~0.5B-parameter Llama checkpoint of ``bench/memory/run.py``: written once (bf16,
~1 GB, sharded with an index) and reused; its tensors' sizes read from the safetensors headers."""

import json
import math
import os
import time
import tempfile

DEFAULT_CKPT = os.path.join(tempfile.gettempdir(), "nxd_hf_bench", "llama-0.5b")  # built once, reused by later runs
MODEL = dict(hidden_size=1280, intermediate_size=3456, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)


def ensure_checkpoint(path: str) -> None:
    """Write a random bf16 Llama checkpoint to ``path`` unless one with this shape is there."""
    import transformers

    config_file, index_file = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(config_file) and os.path.exists(index_file):
        with open(config_file) as f:
            saved = json.load(f)
        if all(saved.get(k) == v for k, v in MODEL.items()):
            print(f"checkpoint: reusing {path}", flush=True)
            return
    import torch

    start = time.perf_counter()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL, dtype="bfloat16")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # ~1 GB, random init
    model.save_pretrained(path, max_shard_size="200MB")
    print(f"checkpoint: wrote {path} in {time.perf_counter() - start:.0f}s", flush=True)


def checkpoint_numels(path: str) -> dict[str, int]:
    """Elements of every tensor in the (sharded) checkpoint, from the safetensors headers."""
    from safetensors import safe_open

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    numels = {}
    for name in sorted(set(weight_map.values())):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            numels.update({key: math.prod(f.get_slice(key).get_shape()) for key in f.keys()})
    return numels


def checkpoint_summary(path: str) -> dict:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        num_files = len(set(json.load(f)["weight_map"].values()))
    num_params = sum(checkpoint_numels(path).values())
    return dict(path=path, files=num_files, num_params=num_params, param_bytes=2 * num_params, dtype="bfloat16",
                config=MODEL)
