"""Which experts modules expert parallelism accepts (nxd_hf/moe/ep_dispatch.py, ep_dense.py): HF's
routed fused experts and the known dense ones (Llama 4); any other experts module called on the
hidden states alone is refused with a ValueError naming the fix."""

import pytest
import torch
import transformers
from torch import nn

from nxd_hf.moe.ep_dispatch import check_expert_parallel


class _DenseUnknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 16))

    def forward(self, hidden_states):
        return hidden_states


def test_llama4_dense_experts_are_accepted():
    config = transformers.Llama4TextConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)
    experts = transformers.models.llama4.modeling_llama4.Llama4TextExperts(config)
    check_expert_parallel([("feed_forward.experts", experts)], 2)
    with pytest.raises(ValueError, match="4 experts, not divisible by expert_parallel_size=3"):
        check_expert_parallel([("feed_forward.experts", experts)], 3)


def test_unknown_experts_called_on_hidden_states_alone_are_refused():
    with pytest.raises(ValueError, match="nor is it a known dense experts module.*use expert_parallel_size=1"):
        check_expert_parallel([("mlp.experts", _DenseUnknown())], 2)
