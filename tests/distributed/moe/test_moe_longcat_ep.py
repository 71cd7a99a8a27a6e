"""Expert parallelism for LongCat-Flash (routed experts split over EP, identity experts on the
token's own rank; before transformers 5.25 gate_up_proj's identity-expert slots in the last rank's
block), at ep=2 and tp2 x ep2, exact against HF."""

import pytest
import torch
from support.moe import MOE_TINY, tiny_config
from support.moe_tp_ep import tp_ep_training_matches_hf
from support.moe_tp_ep_ckpt import checkpoint_reshards, pretrained_round_trip_at_tp2_ep2


ROUTED = MOE_TINY["longcat_flash"][2]["n_routed_experts"]  # router indices from here on: identity experts


def _gate_up_slots() -> int:
    """transformers <5.25 gives LongCat's gate_up_proj a slot per identity expert too (4 routed + 2);
    from 5.25 its MoE block adds the identity experts itself and the experts hold the routed ones."""
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    return LongcatFlashExperts(tiny_config("longcat_flash")).gate_up_proj.shape[0]


# ep rank 0 stores experts [0, 2), rank 1 the rest of gate_up_proj
EXPERT_BLOCKS = [(0, 2), (2, _gate_up_slots())]


def training_matches_hf(tp: int, ep: int, starve: bool = False) -> int:
    """``support.moe_tp_ep.tp_ep_training_matches_hf`` (DP-mean loss, every gathered gradient, 3 AdamW
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


@pytest.mark.parametrize("tp,ranks", [(1, "ranks2"), (2, "ranks4")], ids=["ep2", "tp2_ep2"])
def test_longcat_ep_matches_hf(request, tp, ranks):
    """Loss, every gathered gradient over 3 AdamW steps, eval logits; some tokens reach identity experts."""
    hits = request.getfixturevalue(ranks).run(training_matches_hf, tp, 2)
    assert all(h > 0 for h in hits), hits


def test_longcat_ep2_starved_rank_keeps_identity_rows(ranks2):
    """Every weighted choice goes to ep rank 0's experts: rank 1 receives no row, still runs its own
    identity rows and joins every backward exchange; exact against HF routed the same way."""
    hits = ranks2.run(training_matches_hf, 1, 2, True)
    assert all(h > 0 for h in hits), hits


def test_longcat_checkpoint_ep2_reloads_at_ep1(ranks2, tmp_path):
    """save_checkpoint at ep=2, load at ep=1 (dp 2) and ep=2: states equal, the next step too."""
    boxes = ranks2.run(checkpoint_reshards, "longcat_flash", str(tmp_path / "ckpt"), (1, 2), [(1, 1), (1, 2)])[0]
    assert sorted({experts for experts, _ in boxes}) == EXPERT_BLOCKS, boxes


def test_longcat_checkpoint_tp2_ep2_reshards(ranks4, tmp_path):
    boxes = ranks4.run(checkpoint_reshards, "longcat_flash", str(tmp_path / "ckpt"), (2, 2),
                       [(1, 1), (1, 2), (2, 1), (2, 2)])[0]
    assert sorted({experts for experts, _ in boxes}) == EXPERT_BLOCKS, boxes


def test_longcat_from_pretrained_save_pretrained_consolidate_at_tp2_ep2(ranks4, tmp_path):
    """from_pretrained reads only this rank's bytes of transformers' per-expert tensors; save_pretrained
    and consolidate load in plain transformers with the same logits."""
    for result in ranks4.run(pretrained_round_trip_at_tp2_ep2, "longcat_flash", str(tmp_path)):
        assert result["bytes_read"] == result["local_bytes"], result


def test_longcat_zero1_at_ep2_dp4_reshards(ranks4, tmp_path):
    """ZeRO-1 at ep=2, dp=4 (expert params, uneven blocks, sharded over expert_data): its sharded state
    saved at ep=2 loads at ep=1 and ep=2, the next step equal to the uninterrupted run."""
    ranks4.run(checkpoint_reshards, "longcat_flash", str(tmp_path / "ckpt"), (1, 2), [(1, 1), (1, 2)], True)
