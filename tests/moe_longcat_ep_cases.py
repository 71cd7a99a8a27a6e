"""Expert parallelism for LongCat-Flash: routed experts split over the expert group,
identity ("zero") experts kept on the token's own rank, exact against the unparallelized HF model
(the tiny model is ``moe_cases.MOE_TINY["longcat_flash"]``). Run by
tests/distributed/test_moe_longcat_ep.py at ep=2 (world 2) and tp2 x ep2 (world 4)."""

import torch

from moe_cases import MOE_TINY
from moe_tp_ep_cases import tp_ep_training_matches_hf

ROUTED = MOE_TINY["longcat_flash"][2]["n_routed_experts"]  # router indices from here on: identity experts


def training_matches_hf(tp: int, ep: int, starve: bool = False) -> int:
    """``moe_tp_ep_cases.tp_ep_training_matches_hf`` (DP-mean loss, every gathered gradient, 3 AdamW
    steps, eval logits) on LongCat; returns the assignments routed to identity experts (by HF's
    and nxd's routers: the test cannot pass without some). ``starve``: weighted choices go to the
    first ep rank's experts only (the last rank receives no row but keeps its identity rows)."""
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashTopkRouter

    hits = []

    def count(module, _inputs, output):
        if isinstance(module, LongcatFlashTopkRouter):
            indices = torch.where(output[2] < ROUTED, output[2] % (ROUTED // ep), output[2]) if starve else output[2]
            hits.append(int((indices >= ROUTED).sum()))
            return output[0], output[1], indices

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        tp_ep_training_matches_hf("longcat_flash", tp, ep, False, False)
    finally:
        handle.remove()
    return sum(hits)
