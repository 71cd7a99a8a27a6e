"""How one replica's batch is split over its context-parallel (CP) ranks, and which key blocks
each query block may see.

The sequence (padded at the end to a multiple of 2 x cp) is cut into 2 x cp chunks of ``c``
tokens; CP rank ``r`` holds chunks ``r`` and ``2cp - 1 - r`` (one from each end, as Megatron and
torchtitan do), so every rank does the same causal work. Everything a rank needs to mask its
attention — the global token index (causality), the document of each token (packed sequences,
no cross-document attention) and which keys are padding — is known on every rank from the full
batch before the split, so nothing but K/V (ring) or Q/K/V (all-to-all) travels between ranks.

Padding added at the end to reach a multiple of 2 x cp needs no mask: its keys come after every
real token (causality hides them) and its labels are ignored.
"""

import dataclasses

import torch
import torch.nn.functional as F

from nxd_hf import backend

IGNORE_INDEX = -100


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) CP rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_index(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Positions in the (padded) sequence that CP rank ``cp_rank`` holds, in its local order."""
    assert seq_len % (2 * cp_size) == 0
    c = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(cp_rank, cp_size)])


def split_sequence(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's chunks of ``tensor`` along ``dim`` (the sequence)."""
    index = local_index(tensor.shape[dim], cp_rank, cp_size).to(tensor.device)
    return tensor.index_select(dim, index)


def documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document id of every token of a packed batch (a new one wherever the position does not
    go up by one), as ``transformers.masking_utils.find_packed_sequence_indices``; None when every
    row is one document."""
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    docs = starts.cumsum(-1)
    return None if bool((docs[:, -1] == 0).all()) else docs


@dataclasses.dataclass(eq=False)
class ContextBatch:
    """What the attention of every layer needs to know about the current batch (full sequence,
    before the split). ``doc``: [b, S] document ids or None; ``key_valid``: [b, S] False at
    padding keys, or None."""

    seq_len: int  # padded to a multiple of 2 x cp
    num_tokens: int  # before the padding
    cp_rank: int
    cp_size: int
    device: torch.device = torch.device("cpu")
    doc: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None
    _blocks: dict = dataclasses.field(default_factory=dict, repr=False)

    def gather(self, local: torch.Tensor, group) -> torch.Tensor:
        """The full sequence [b, num_tokens, ...] from every CP rank's chunks of it [b, s/cp, ...]
        (no gradient: for outputs read in evaluation)."""
        gathered = backend.all_gather(local.detach().contiguous(), 1, group)
        order = torch.cat([local_index(self.seq_len, r, self.cp_size) for r in range(self.cp_size)])
        full = torch.empty_like(gathered)
        full[:, order.to(full.device)] = gathered
        return full[:, :self.num_tokens]

    def token_mask(self, rows: int) -> torch.Tensor:
        """[rows, 2 x chunk] bool: which of this rank's tokens are the batch's (not the padding
        added to a multiple of 2 x cp, nor masked out by the attention mask)."""
        index = local_index(self.seq_len, self.cp_rank, self.cp_size).to(self.device)
        valid = (index < self.num_tokens)[None].expand(rows, -1)
        return valid if self.key_valid is None else valid & self.key_valid[:, index]

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp_size)

    def mask(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor | None:
        """[b or 1, len(q), len(k)] bool (True: may attend), or None for "everything"."""
        allowed = (q_index[:, None] >= k_index[None, :])[None]
        if self.doc is not None:
            allowed = allowed & (self.doc[:, q_index, None] == self.doc[:, None, k_index])
        if self.key_valid is not None:
            allowed = allowed & self.key_valid[:, None, k_index]
        return None if bool(allowed.all()) else allowed

    def ring_tiles(self, step: int, tile: int) -> list[tuple[slice, slice, torch.Tensor | None]]:
        """At ring step ``step`` this rank holds the K/V of CP rank ``(cp_rank - step) % cp``: the
        (local query slice, received key slice, mask) of every ``tile`` x ``tile`` tile that sees
        anything (tiles above the causal diagonal or across documents only are skipped; a tile
        below the diagonal, in one document, without padding has no mask). Masks exist for
        tiles only, so their memory grows with the sequence, not its square."""
        if (step, tile) in self._blocks:  # the same for every layer of this batch
            return self._blocks[step, tile]
        c, cp = self.chunk, self.cp_size
        tiles = self._blocks[step, tile] = []
        for qi, q_chunk in enumerate(chunk_ids(self.cp_rank, cp)):
            for ki, k_chunk in enumerate(chunk_ids((self.cp_rank - step) % cp, cp)):
                if k_chunk > q_chunk:
                    continue
                for q0 in range(0, c, tile):
                    q1 = min(q0 + tile, c)
                    for k0 in range(0, c, tile):
                        k1 = min(k0 + tile, c)
                        qa, ka = q_chunk * c, k_chunk * c  # global index of the chunks' first tokens
                        if ka + k0 > qa + q1 - 1:
                            continue
                        mask = None
                        if ka + k1 - 1 > qa + q0 or self.doc is not None or self.key_valid is not None:
                            mask = self.mask(torch.arange(qa + q0, qa + q1, device=self.device),
                                             torch.arange(ka + k0, ka + k1, device=self.device))
                            if mask is not None and not bool(mask.any()):
                                continue
                        tiles.append((slice(qi * c + q0, qi * c + q1), slice(ki * c + k0, ki * c + k1), mask))
        return tiles

    @property
    def gathered_mask(self) -> torch.Tensor | None:
        """The mask of the whole sequence in the order an all-to-all gathers it (CP rank by rank,
        each rank's two chunks)."""
        if "gathered" not in self._blocks:  # the same for every layer of this batch
            order = torch.cat([local_index(self.seq_len, r, self.cp_size) for r in range(self.cp_size)])
            self._blocks["gathered"] = self.mask(order.to(self.device), order.to(self.device))
        return self._blocks["gathered"]


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM shift (``ForCausalLMLoss``), done before the split: token t's label is
    token t+1's, the last one ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def pad_to_multiple(tensor: torch.Tensor, multiple: int, value) -> torch.Tensor:
    """``tensor`` [b, S, ...] padded at the end of the sequence to a multiple of ``multiple``."""
    extra = -tensor.shape[1] % multiple
    if not extra:
        return tensor
    fill = tensor[:, -1:].expand(tensor.shape[0], extra, *tensor.shape[2:]).clone()
    if value is not None:
        fill.fill_(value)
    return torch.cat([tensor, fill], dim=1)
