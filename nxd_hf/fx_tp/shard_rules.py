"""How one traced op carries a tensor sharded along one dimension (``nxd_hf.fx_tp.derive``).

``rule(node, sharded, shape, modules, tp)`` answers, for a node with at least one sharded input, one of:
``("dim", d)`` (its output is sharded along ``d``), ``("row",)`` (an ``nn.Linear`` whose input
is sharded along its last dim: a row-parallel layer, replicated output), ``("size",)`` (a size
query of a dim that is not sharded), ``("need", node)`` (exact only if that operand were sharded
too) or ``("fail", why)`` (not exact: the plan leaves it replicated). A value is sharded in
contiguous blocks of its dim, so an op is exact on the local blocks when it treats the blocks
of that dim independently: elementwise ops, transposes, reshapes keeping the dim outermost in
its group, attention and batched matmuls over it.
"""

import math
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

UNARY_FUNCTIONS = {F.relu, F.gelu, F.silu, F.dropout, F.sigmoid, F.tanh, torch.relu, torch.tanh, torch.sigmoid,
                   torch.exp, operator.neg, torch.neg, F.leaky_relu, F.elu, F.mish, torch.square, torch.rsqrt}
UNARY_METHODS = {"relu", "sigmoid", "tanh", "exp", "contiguous", "float", "half", "bfloat16", "to", "type_as",
                 "clone", "neg", "square", "__neg__", "detach"}
UNARY_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU, nn.ELU,
                 nn.Mish)
BINARY_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul,
                    torch.div, operator.iadd, operator.imul}
BINARY_METHODS = {"add", "sub", "mul", "div", "masked_fill", "__add__", "__mul__", "__sub__", "__truediv__"}
SOFTMAX = {F.softmax, torch.softmax, F.log_softmax, torch.log_softmax}
MATMUL = {torch.matmul, operator.matmul, torch.bmm}
SHAPE_METHODS = {"view", "reshape"}
TRANSPOSE = {"transpose", "permute", "t"}


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def view_dim(in_shape, out_shape, d: int, tp: int) -> int | None:
    """The output dim of a reshape that holds input dim ``d``'s ``tp`` blocks: the one starting at
    the same flat offset (split or merge with ``d`` outermost) whose size ``tp`` divides, else None."""
    before = math.prod(in_shape[:d])
    for j in range(len(out_shape)):
        if math.prod(out_shape[:j]) == before and out_shape[j] > 1:
            if (in_shape[d] % out_shape[j] == 0 or out_shape[j] % in_shape[d] == 0) and out_shape[j] % tp == 0:
                return j
            return None
    return None


def _tensor_args(node: fx.Node):
    return [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]


def _broadcast(node: fx.Node, sharded: dict, shape) -> tuple:
    """Binary elementwise: every operand either sharded along the same aligned dim with the same
    size, or broadcasting there (absent or size 1)."""
    out = shape(node)
    if out is None:
        return ("fail", "non-tensor result")
    dims = {}
    operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
    if node.target == "masked_fill" or node.target in ("__add__", "__mul__", "__sub__", "__truediv__"):
        operands = [a for a in node.args if isinstance(a, fx.Node)]
    for a in operands:
        s = shape(a)
        if s is None:
            continue
        if a in sharded:
            dims[a] = sharded[a] + len(out) - len(s)
    if len(set(dims.values())) != 1:
        return ("fail", "operands sharded along different dims")
    d = next(iter(dims.values()))
    for a in operands:
        s = shape(a)
        if s is None or a in sharded:
            continue
        k = d - (len(out) - len(s))
        if k >= 0 and s[k] != 1:
            return ("need", a)
    return ("dim", d)


def rule(node: fx.Node, sharded: dict, shape, modules: dict[str, nn.Module], tp: int) -> tuple:
    inputs = [a for a in _tensor_args(node) if a in sharded]
    first = inputs[0]
    d = sharded[first]
    if node.op == "output":
        return ("fail", "a sharded value is an output of the module")
    if node.op == "call_module":
        module = modules[node.target]
        if isinstance(module, nn.Linear) and node.args[0] in sharded and len(inputs) == 1:
            if sharded[node.args[0]] == len(shape(node.args[0])) - 1:
                return ("row",)
            return ("fail", "linear over a dim that is not sharded")
        if isinstance(module, UNARY_MODULES):
            return ("dim", d)
        if isinstance(module, nn.Softmax) and _dim(module.dim, len(shape(node))) != d:
            return ("dim", d)
        return ("fail", f"module {type(module).__name__}")
    target = node.target
    if node.op == "call_function" and target in UNARY_FUNCTIONS and len(inputs) == 1 and node.args[0] is first:
        return ("dim", d)
    if node.op == "call_method" and target in UNARY_METHODS and len(inputs) == 1 and node.args[0] is first:
        return ("dim", d)
    if (node.op == "call_function" and target in BINARY_FUNCTIONS) or (
            node.op == "call_method" and target in BINARY_METHODS):
        return _broadcast(node, sharded, shape)
    if target in SOFTMAX or (node.op == "call_method" and target == "softmax"):
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if dim is not None and _dim(dim, len(shape(node))) != d:
            return ("dim", d)
        return ("fail", "softmax over the sharded dim")
    if node.op == "call_method" and target in TRANSPOSE or target is torch.transpose or target is torch.permute:
        return _transpose(node, d, shape)
    if node.op == "call_method" and target in SHAPE_METHODS or target is torch.reshape:
        j = view_dim(shape(first), shape(node), d, tp)
        return ("dim", j) if j is not None else ("fail", "reshape mixes the sharded dim with others")
    if node.op == "call_method" and target == "repeat_interleave" and isinstance(node.args[1], int):
        return ("dim", d)  # per head (GQA's K/V): local K/V heads repeat into the local query heads
    if target is F.scaled_dot_product_attention:
        return _attention(node, sharded, shape)
    if target in MATMUL or (node.op == "call_method" and target == "matmul"):
        a, b = node.args[:2]
        if d >= len(shape(node)) - 2:
            return ("fail", "matmul over the sharded dim")
        for x in (a, b):
            if x not in sharded:
                return ("need", x)
        return ("dim", d) if sharded[a] == sharded[b] else ("fail", "matmul operands sharded differently")
    if node.op == "call_method" and target == "size" or (node.op == "call_function" and target is getattr):
        return _size(node, d, shape)
    if node.op == "call_function" and target is operator.getitem and not isinstance(shape(node), (list, tuple)):
        return ("fail", "indexing a sharded tensor")
    return ("fail", f"{node.op} {getattr(target, '__name__', target)}")


def _transpose(node, d, shape) -> tuple:
    ndim = len(shape(node))
    if node.target == "t":
        return ("dim", 1 - d)
    if node.target == "permute" or node.target is torch.permute:
        dims = node.args[1:] if node.op == "call_method" else node.args[1]
        dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else list(dims)
        return ("dim", [_dim(x, ndim) for x in dims].index(d))
    a, b = (_dim(x, ndim) for x in node.args[1:3])
    return ("dim", b if d == a else a if d == b else d)


def _attention(node, sharded, shape) -> tuple:
    q, k, v = node.args[:3]
    d = sharded.get(q)
    if d is None or d >= len(shape(q)) - 2:
        return ("fail", "attention over the sharded dim") if d is not None else ("need", q)
    for x in (k, v):
        if x not in sharded:
            return ("need", x)
        if sharded[x] != d:
            return ("fail", "q, k, v sharded differently")
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    if isinstance(mask, fx.Node):
        s = shape(mask)
        if mask in sharded:
            if sharded[mask] + len(shape(node)) - len(s) != d:
                return ("fail", "mask sharded differently")
        elif s is not None and d - (len(shape(node)) - len(s)) >= 0 and s[d - (len(shape(node)) - len(s))] != 1:
            return ("need", mask)
    return ("dim", d)


def _size(node, d, shape) -> tuple:
    """``x.size(i)`` / ``x.shape[i]`` of a dim that is not sharded is the same on every rank."""
    source = node.args[0]
    ndim = len(shape(source))
    if node.op == "call_method":
        index = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if index is not None:
            return ("size",) if _dim(index, ndim) != d else ("fail", "size of the sharded dim")
    elif node.args[1] != "shape":
        return ("fail", f"attribute {node.args[1]}")
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)
                and _dim(user.args[1], ndim) != d):
            return ("fail", "the whole shape of a sharded tensor is used")
    return ("size",)
