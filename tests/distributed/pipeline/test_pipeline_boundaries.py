"""A value crossing a pipeline boundary that has no gradient path on the receiving stage (used
there detached): the receiving stage has no gradient for it, torch's stage sends zeros in its
place, so the sending stage never waits for a gradient that does not come. Short timeout: a
regression fails instead of hanging the suite."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from support.reference_fixes import TOL, Block


class DetachedSideNet(nn.Module):
    """``side`` is made before the first block (stage 0) and read detached after the last (stage 1)."""

    def __init__(self):
        super().__init__()
        self.inp, self.side, self.head = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, features, labels):
        h, side = self.inp(features), self.side(features)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h + side.detach()), labels)


def detached_boundary_value_case() -> None:
    from nxd_hf.pipeline import NxDPPModel

    torch.manual_seed(0)
    reference = DetachedSideNet()
    pp_model = NxDPPModel(copy.deepcopy(reference), transformer_layer_cls=Block, num_microbatches=2,
                          input_names=["features", "labels"], tracer_cls="torch", pipeline_cuts=["blocks.0"],
                          broadcast_and_average_loss=True)
    g = torch.Generator().manual_seed(1)
    features, labels = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    loss = pp_model.run_train(features=features, labels=labels)
    ref_loss = reference(features, labels)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in pp_model.local_named_parameters():
        expected = ref_params[name].grad
        torch.testing.assert_close(param.grad, torch.zeros_like(param) if expected is None else expected, **TOL)


def test_detached_boundary_value_never_waits(ranks2):
    ranks2.run(detached_boundary_value_case, model_parallel=(1, 2), timeout_s=60)
