"""Memory traffic and matmul FLOPs of one forward + backward of the causal-LM loss from the hidden
states at a GPU shape, counted op by op on fake tensors (nothing is computed, so the Llama-3.2-1B
head fits on a CPU): unfused (``F.linear`` then ``F.cross_entropy`` of the upcast logits, as plain
HF) against nxd_hf's ``fused_linear_cross_entropy`` at tp=1, with torch's eager ops ("fused") and
with its Triton kernels ("fused_triton", each launch one custom op: the logits it reads and
overwrites; counted, not run: no kernel is launched, but the row needs Triton installed).

Per op: the bytes of its inputs read and of its new outputs written (an in-place op's target read
and written); views, ``empty`` and shape queries move nothing; gather/scatter ops only their
index's elements. Matmuls apart: their FLOPs and their operands' bytes (each read once per call,
the output written once; an ``addmm_`` target read and written). A model of a GPU's HBM traffic,
not a measurement: caches and fusion inside a kernel are not seen. JSON in
``bench/results/fused_loss_traffic.json``. Run from the repo root:
``python -m bench.fused_loss.traffic [--tokens 8192] [--vocab 128256] [--hidden 2048]``.
"""

import argparse
import collections
import json
import os

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import RESULTS
from bench.common.stamp import stamp
from bench.common.table import Column, table

MATMULS = {"aten.mm", "aten.addmm", "aten.addmm_", "aten.bmm"}
NOTHING = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty"}
INDEXED = {"aten.gather", "aten.scatter_add_", "aten.scatter_add", "aten.scatter", "aten.scatter_", "aten.index_select"}


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Traffic(TorchDispatchMode):
    """Counts what the module docstring says, per kind ("matmul", "elementwise") and per op."""

    def __init__(self):
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name.startswith("prim.") or func.is_view or name in NOTHING:
            return out
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in INDEXED:  # an index, and as many elements read and written
            index = next(t for t in inputs if t.dtype == torch.long)
            moved = _bytes(index) + 3 * index.numel() * 4
        else:
            moved = sum(map(_bytes, inputs)) + sum(_bytes(t) for t in outputs if not any(t is i for i in inputs))
            if name.endswith("_") and outputs:  # in place: the target written back
                moved += _bytes(outputs[0])
            elif name.startswith("nxd_hf."):  # a custom op (a Triton kernel): what it overwrites, written back
                moved += sum(_bytes(a) for a, arg in zip(args, func._schema.arguments)
                             if arg.alias_info is not None and arg.alias_info.is_write)
        if name in MATMULS:
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        self.bytes["matmul" if name in MATMULS else "elementwise"] += moved
        self.by_op[name] += moved
        return out


def _count(way: str, tokens: int, vocab: int, hidden: int) -> Traffic:
    from nxd_hf.parallel_layers.fused_loss import fused_linear_cross_entropy

    with FakeTensorMode():
        hidden_states = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,))
        with Traffic() as traffic:
            if way.startswith("fused"):
                loss = fused_linear_cross_entropy(hidden_states, weight, labels, vocab_size=vocab, check_labels=False,
                                                  kernel="triton" if way == "fused_triton" else "torch")
            else:
                loss = F.cross_entropy(F.linear(hidden_states, weight).float(), labels)
            loss.backward()
    return traffic


COLUMNS = [Column(title="way", width=12, left=True), Column(title="matmul TFLOP", width=12, spec=".2f"),
           Column(title="matmul GB", width=9, spec=".1f"), Column(title="elementwise GB", width=14, spec=".1f"),
           Column(title="total GB", width=8, spec=".1f")]


def format_table(result: dict) -> str:
    return "\n".join(table(COLUMNS, [(way, r["matmul_tflop"], r["matmul_gb"], r["elementwise_gb"], r["total_gb"])
                                     for way, r in result["ways"].items()]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="batch x seq (the 1B bench: 4 x 2048)")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    from nxd_hf import parallel_state
    from nxd_hf.parallel_layers.fused_loss import CHUNK_ELEMENTS, KERNEL_CHUNK_BYTES

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29572"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    parallel_state.initialize_model_parallel(1, 1)
    ways = {}
    from nxd_hf.parallel_layers import softmax_kernels

    os.environ["TRITON_INTERPRET"] = "1"  # the kernels' custom ops accept CPU (fake) tensors; nothing runs
    for way in ("unfused", "fused") + (("fused_triton",) if softmax_kernels.TRITON_INSTALLED else ()):
        traffic = _count(way, args.tokens, args.vocab, args.hidden)
        ways[way] = {"matmul_tflop": traffic.flops / 1e12, "matmul_gb": traffic.bytes["matmul"] / 1e9,
                     "elementwise_gb": traffic.bytes["elementwise"] / 1e9,
                     "total_gb": sum(traffic.bytes.values()) / 1e9,
                     "by_op_gb": {op: b / 1e9 for op, b in traffic.by_op.most_common() if b >= 1e8}}
    result = {**stamp(), "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "dtype": "bfloat16",
              "chunk_tokens": max(1, CHUNK_ELEMENTS // args.vocab),
              "kernel_chunk_tokens": max(1, KERNEL_CHUNK_BYTES // 2 // args.vocab), "ways": ways,
              **{f"total_ratio_{way}_over_unfused": ways[way]["total_gb"] / ways["unfused"]["total_gb"]
                 for way in ways if way != "unfused"}}
    print(format_table(result))
    with_kernels = result.get("total_ratio_fused_triton_over_unfused")
    print(f"fused / unfused traffic: {result['total_ratio_fused_over_unfused']:.3f}, with the Triton kernels "
          f"{'(Triton is not installed)' if with_kernels is None else f'{with_kernels:.3f}'} "
          f"({-(-args.tokens // result['chunk_tokens'])} chunks of {result['chunk_tokens']} tokens; with the kernels "
          f"{-(-args.tokens // result['kernel_chunk_tokens'])} of {result['kernel_chunk_tokens']})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fused_loss_traffic.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
