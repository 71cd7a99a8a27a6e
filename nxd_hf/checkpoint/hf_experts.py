"""Fused experts read from (and written as) the per-expert tensors transformers stores.

transformers 5 keeps a mixture-of-experts layer's experts fused in memory (``experts.gate_up_proj``
``[experts, 2 x intermediate, hidden]``) and per expert on disk (``experts.3.w1.weight``); its
``WeightConverter``s (``MergeModulelist`` stacking the experts, then ``Concatenate`` of the
gate and up projections) say how. ``ExpertSources`` follows them for a model name: it reads only
the experts a rank holds (``expert_shard_index`` under expert parallelism, all otherwise), so no
rank reads the others' experts. ``per_expert_state_dict`` is the reverse, for ``consolidate``:
transformers' own ``revert_weight_conversion`` on the fused tensors.
"""

import dataclasses
import re

import torch


@dataclasses.dataclass(kw_only=True)
class _Converter:
    target: str  # plain substring of the model name, e.g. ".experts.gate_up_proj"
    sources: list[str]  # per-expert names with "*" for the expert, e.g. ".experts.*.w1.weight"
    concat_dim: int | None  # Concatenate's dim after stacking (None: stacking only)


def _plain(pattern: str) -> str | None:
    """A converter's regex pattern as a plain string (None when it is more than escaped dots and one "*")."""
    text = pattern.replace("\\.", ".")
    return None if re.search(r"[\\^$()\[\]+?|{}]", text) else text


def _converters(hf_model) -> list[_Converter]:
    """The stacking converters (MergeModulelist(0) [+ Concatenate]) transformers registers for ``hf_model``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    try:
        conversions = get_model_conversion_mapping(hf_model, add_legacy=False) or []
    except Exception:  # an architecture transformers has no mapping for
        return []
    found = []
    for conversion in conversions:
        if not isinstance(conversion, WeightConverter) or len(conversion.target_patterns) != 1:
            continue
        ops = conversion.operations
        if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
            continue
        if len(ops) > 2 or (len(ops) == 2 and not isinstance(ops[1], Concatenate)):
            continue
        target, sources = _plain(conversion.target_patterns[0]), [_plain(s) for s in conversion.source_patterns]
        if target is None or None in sources or not all(s.count("*") == 1 for s in sources):
            continue
        found.append(_Converter(target=target, sources=sources, concat_dim=ops[1].dim if len(ops) == 2 else None))
    return found


class ExpertSources:
    """Model name of a fused experts tensor -> its value read from the per-expert checkpoint keys.
    ``key_of``: model name -> checkpoint key (``HFKeys``: renames such as Mixtral's
    ``block_sparse_moe`` -> ``mlp`` applied)."""

    def __init__(self, hf_model, key_of):
        self._hf_model, self._key_of, self._converters = hf_model, key_of, None

    def keys(self, name: str, experts: list[int]) -> tuple[list[list[str]], int | None] | None:
        """([source][expert] checkpoint keys holding ``name``'s experts, the Concatenate dim), or
        None when ``name`` is not stored per expert."""
        if self._converters is None:
            self._converters = _converters(self._hf_model)
        for converter in self._converters:
            if not name.endswith(converter.target):
                continue
            prefix = name[: len(name) - len(converter.target)]
            keys = [[self._key_of(prefix + s.replace("*", str(e))) for e in experts] for s in converter.sources]
            if all(k is not None for row in keys for k in row):
                return keys, converter.concat_dim
        return None

    def read(self, checkpoint, name: str, experts: list[int]) -> torch.Tensor:
        """``name``'s experts ``experts`` stacked as transformers fuses them (``keys`` found them)."""
        keys, concat_dim = self.keys(name, experts)
        stacked = [torch.stack([checkpoint.read(k) for k in row]) for row in keys]
        return stacked[0] if concat_dim is None else torch.cat(stacked, dim=concat_dim)


def per_expert_writer(config_dir: str):
    """``fn(tensors) -> tensors`` turning the fused experts among ``tensors`` (on-disk names) into
    the per-expert tensors transformers' ``save_pretrained`` writes (its ``revert_weight_conversion``),
    other tensors unchanged; None when the model in ``config_dir`` stores nothing per expert."""
    import os

    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    if not os.path.exists(os.path.join(config_dir, "config.json")):
        return None
    model = None
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):  # the conversions name both alike
        try:
            with torch.device("meta"):
                model = auto.from_config(transformers.AutoConfig.from_pretrained(config_dir))
            break
        except Exception:  # noqa: BLE001  not such a model, or not a transformers config: tensors as stored
            continue
    if model is None:
        return None
    targets = [c.target for c in _converters(model)]
    if not targets:
        return None

    def convert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fused = {n: t for n, t in tensors.items() if any(n.endswith(target) for target in targets)}
        if not fused:
            return tensors
        rest = {n: t for n, t in tensors.items() if n not in fused}
        return {**rest, **revert_weight_conversion(model, fused)}
    return convert
