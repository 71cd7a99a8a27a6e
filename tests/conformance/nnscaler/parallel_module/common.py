#  Copyright (c) Microsoft Corporation.
#  Licensed under the MIT License.
#
#  From microsoft/nnscaler's tests/parallel_module/common.py (commit 1585c15). Changed:
#  init_distributed joins gloo (the rank pool has joined it already) instead of nccl and sets no
#  CUDA device; PASMegatron, a policy over nnScaler's IR graph, is nxd_hf's "hybrid" policy (end of file).
"""nnScaler's shared test modules and helpers."""

import math
from typing import Any, Tuple

import torch
from torch import nn
import numpy as np

from ..utils import init_random


def create_mesh(ngpus: int, group_num: Tuple[int]) -> Tuple[Tuple[Tuple[int]]]:
    """
    Create hybrid (nested) groups given the each group number.

    The product of group_num should be same with total devices.

    e.g., 6 device to 2 x 3 mesh will results [dim][group_id] = tuple[int]:
        (
            ( (0,1,2), (3,4,5) ),
            ( (0,3), (2,5), (3,6) ),
        )
    """
    group_num = np.array(group_num)
    cnt = np.prod(group_num)
    assert cnt == ngpus, 'total device not match'
    grid = np.arange(cnt).reshape(tuple(group_num))
    dims = list(range(len(group_num)))
    outputs = []
    for dim, num in enumerate(group_num):
        remain = ngpus // num
        order = tuple(dims[:dim] + dims[dim+1:] + [dim])
        grid_dim = np.transpose(grid, order).reshape((remain,num))
        grid_dim = grid_dim.tolist()
        outputs.append(tuple(tuple(ranks) for ranks in grid_dim))
    assert len(outputs) == len(group_num)
    return tuple(outputs)


class CubeLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=False):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features, bias=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        else:
            self.register_parameter('bias', None)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.kaiming_uniform_(self.fc.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = torch.nn.init._calculate_fan_in_and_fan_out(self.fc.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x):
        x = self.fc(x)
        if self.bias is not None:
            x = x + self.bias
        return x


def init_distributed():
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend='gloo')


def assert_equal(a: Any, b: Any):
    assert type(a) == type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a.cpu(), b.cpu())
    elif isinstance(a, dict):
        assert len(a) == len(b)
        for k in a.keys():
            assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for i in range(len(a)):
            assert_equal(a[i], b[i])
    else:
        assert a == b


def assert_close(a: Any, b: Any, atol=1e-6, rtol=1e-6):
    assert type(a) == type(b)
    if isinstance(a, torch.Tensor):
        assert torch.allclose(a.cpu(), b.cpu(), atol=atol, rtol=rtol)
    elif isinstance(a, dict):
        assert len(a) == len(b)
        for k in a.keys():
            assert_close(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for i in range(len(a)):
            assert_close(a[i], b[i])
    else:
        raise ValueError(f'unsupported type {type(a)}')


# nnScaler's PASMegatron (pas_config's pipeline_nstages stages cut between the linears, each
# stage's linears tensor-parallel, alternating column and row) is a policy over nnScaler's IR
# graph; nxd_hf's equivalent is its "hybrid" policy (docs/nnscaler.md: pipeline_nstages stages
# cut between the blocks of the ModuleList, each stage tensor-parallel with the derived layout).
PASMegatron = 'hybrid'
