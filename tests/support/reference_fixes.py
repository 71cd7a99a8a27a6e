"""Pieces shared by the reference-fix, reference-sample and pipeline-boundary tests: a small block
module, the tolerance, and ``run_named`` (run the named cases in order, collecting each one's
traceback)."""

import traceback

import torch
from torch import nn

from support import hf_parity


TOL = hf_parity.TOL


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.relu(self.linear(x))


def run_named(cases: list, tmp: str, names: list[str]) -> dict:
    """{name: None or its traceback} for each of ``cases`` named in ``names``, run in order."""
    results = {}
    for case in cases:
        if case.__name__ in names:
            try:
                case(tmp)
                results[case.__name__] = None
            except Exception:
                results[case.__name__] = traceback.format_exc()
    return results
