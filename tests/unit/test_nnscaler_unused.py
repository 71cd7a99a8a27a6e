"""Parameters the traced graphs do not read leave the parallel module (nnScaler's rule), in-process."""

import torch
from torch import nn

from nxd_hf.fx_tp import derive
from nxd_hf.nnscaler import unused


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused_first = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 4)
        self.tied = nn.Linear(4, 4)
        self.tied.weight = self.fc.weight  # one tensor under two names: used, so kept under both
        self.sized_by = nn.Parameter(torch.zeros(3))  # only its size is read: a graph node all the same
        self.eval_only = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x) + self.tied.bias * self.sized_by.shape[0]
        return y if self.training else self.eval_only(y)


def test_unused_parameters_are_dropped_and_the_forward_still_runs():
    module = WithUnused()
    x = torch.randn(2, 4)
    want = {mode: module.train(mode)(x) for mode in (True, False)}
    names = [n for n, _ in module.named_parameters()]
    traced = derive.trace(module, {"x": x})
    dropped = unused.drop_unused_parameters(module, list(traced.graphs.values()))
    assert sorted(dropped) == ["unused_first.bias", "unused_first.weight"]
    assert unused.original_param_names(module) == names
    kept = dict(module.named_parameters(remove_duplicate=False))
    assert set(kept) == {"fc.weight", "fc.bias", "tied.weight", "tied.bias", "sized_by", "eval_only.weight",
                         "eval_only.bias"}
    assert "unused_first.weight" not in module.state_dict()
    assert module.unused_first.weight.shape == (4, 4)  # still readable, as a plain tensor
    for mode in (True, False):
        torch.testing.assert_close(module.train(mode)(x), want[mode])
