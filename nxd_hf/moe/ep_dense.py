"""Expert parallelism for dense experts: every token through every expert (Llama 4, docs/moe.md).

``Llama4TextMoe`` does not route a token to its top-k experts: it repeats every token once per
expert, scaled by the router's score (zero for the experts not selected), and calls its experts
module on these rows laid out expert-major (``[E x T, H]``, a ``bmm`` over the ``[E, T, H]``
view); the block sums the output over the experts. Under expert parallelism (EP ranks hold
different tokens, each ``E / ep`` consecutive experts) the experts' ``forward`` becomes:

1. exchange the token counts over the expert group (a rank's batch may differ in size);
2. send block ``j`` of the expert-major rows (experts of rank ``j``, this rank's tokens) to rank
   ``j`` (``backend.DispatchRows``, one all-to-all: the minimal exchange);
3. lay the received blocks out expert-major over the group's tokens (per local expert, the
   sources in group-rank order) and run HF's own experts ``forward`` on the local experts;
4. return each source its rows (``backend.CombineTokens``): the result is expert-major over all
   ``E`` experts for this rank's tokens, which the block sums over the experts as in HF.

Under TP as well, the TP region's hooks on the module wrap this forward (as for routed experts).
"""

import torch

from nxd_hf import backend

# Experts modules called as ``forward(rows)`` on expert-major rows of every token for every expert.
DENSE_EXPERTS = frozenset({"Llama4TextExperts"})


class DenseExpertParallelForward:
    """The dense experts' ``forward`` under expert parallelism (steps 1-4 of the module docstring)."""

    def __init__(self, local_forward, *, num_local: int, ep: int, group):
        self.local_forward, self.num_local, self.ep, self.group = local_forward, num_local, ep, group

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        width = hidden_states.shape[-1]
        rows = hidden_states.reshape(-1, width)
        experts = self.num_local * self.ep
        assert rows.shape[0] % experts == 0, "dense experts take every token once per expert"
        tokens = rows.shape[0] // experts
        device = backend.collective_device(self.group)
        with backend.comm_tag("ep_counts"):
            counts = backend.exchange_counts(torch.full((self.ep,), tokens, dtype=torch.int64, device=device),
                                             self.group).tolist()  # tokens of each source rank
        send_splits = [self.num_local * tokens] * self.ep
        recv_splits = [self.num_local * count for count in counts]
        received = backend.DispatchRows.apply(recv_splits, send_splits, self.group, rows)
        blocks = [block.view(self.num_local, count, width) for block, count in zip(received.split(recv_splits), counts)]
        local_in = torch.cat(blocks, dim=1).reshape(-1, width)  # [local expert, group's tokens]
        out = self.local_forward(local_in)
        if local_in.requires_grad and not out.requires_grad:  # the backward's all-to-alls still run
            out = out + local_in.sum() * 0
        parts = out.view(self.num_local, sum(counts), -1).split(counts, dim=1)
        back = torch.cat([part.reshape(-1, part.shape[-1]) for part in parts])
        result = backend.CombineTokens.apply(send_splits, recv_splits, self.group, back)
        return result.view(*hidden_states.shape[:-1], result.shape[-1])
