"""ZeRO-1's state on this rank (the optimizer state of its slice and the fp32 master slice):
state_dict / load_state_dict with a layout check, files in the checkpoint format, its size in
bytes, and the checkpoint's optimizer-state protocol (``nxd_hf.checkpoint.optim_state``): each
parameter's state decoded from the flat slices into the parameter's local layout, and back.

Flat layout (``nxd_hf.optim.zero1.flat``): each ``FlatGroup``'s parameters lie end to end; this rank
holds the pieces ``fg.pieces()`` of it in its master (``masters[i]``) and in the inner
optimizer's state, whose params are chunks of that master slice. A ``state_dict`` saved in the
layout before the overlapped reduce-scatter (contiguous, parameters in order) is converted on load (``zero1.relayout``).
"""

import torch

from nxd_hf import backend
from nxd_hf.checkpoint.optim_state import MASTER, ParamStates, set_torch_state
from nxd_hf.optim.zero1.relayout import is_contiguous_layout, load_contiguous_state_dict


class Zero1State:
    """The state of one ``NeuronZero1Optimizer`` (``zero1``), which holds one and forwards its
    state methods to it: it reads the optimizer's ``masters``, inner ``optimizer``,
    ``flat_groups``, ``param_groups``, ``dp_size``, ``dp_rank`` and ``group_of(flat_group)``."""

    def __init__(self, zero1):
        self.zero1 = zero1

    def optimizer_state_bytes(self) -> int:
        """Bytes of this rank's per-element state: the fp32 master slices plus every state
        tensor of the master slices' size (Adam's exp_avg, exp_avg_sq; not scalar step counts)."""
        total = sum(m.numel() * m.element_size() for m in self.zero1.masters)
        for group in self.zero1.optimizer.param_groups:
            for chunk in group["params"]:
                for value in self.zero1.optimizer.state[chunk].values():
                    if isinstance(value, torch.Tensor) and value.numel() == chunk.numel():
                        total += value.numel() * value.element_size()
        return total

    def layout(self) -> dict:
        """What a saved shard must match to be loaded here."""
        return {
            "dp_size": self.zero1.dp_size, "dp_rank": self.zero1.dp_rank,
            "chunks": [len(group["params"]) for group in self.zero1.optimizer.param_groups],
            "groups": [{"group_index": fg.group_index, "dtype": str(fg.dtype), "numel": fg.numel,
                        "shard_numel": fg.shard_numel, "shapes": [list(p.shape) for p in fg.params]}
                       for fg in self.zero1.flat_groups],
            "interleaved": [fg.interleaved for fg in self.zero1.flat_groups],
        }

    def state_dict(self) -> dict:
        """This rank's shard: inner optimizer state, fp32 master slices, param group options
        and the layout they belong to."""
        return {
            "layout": self.layout(),
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in self.zero1.param_groups],
            "masters": [m.detach().clone() for m in self.zero1.masters],
            "inner": self.zero1.optimizer.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        saved, here = state_dict["layout"], self.layout()
        if is_contiguous_layout(saved) and any(here["interleaved"]):
            return load_contiguous_state_dict(self.zero1, state_dict)
        if saved != here:
            diff = [k for k in here if saved.get(k) != here[k]]
            raise ValueError(
                f"this ZeRO-1 shard was saved for another layout (differs in {diff}): load it with the same "
                "data/tensor/pipeline parallel sizes, parameters and param groups it was saved with")
        self.zero1.optimizer.load_state_dict(state_dict["inner"])
        for master, saved_master in zip(self.zero1.masters, state_dict["masters"]):
            master.copy_(saved_master)
        for group, options in zip(self.zero1.param_groups, state_dict["param_groups"]):
            group.update(options)

    def save_sharded_state_dict(self, output_dir: str, save_serially: bool = True) -> None:
        """Write this optimizer's state under ``output_dir`` in nxd_hf's checkpoint format (it
        loads at other DP/TP sizes); ``save_serially``: one rank writes at a time."""
        from nxd_hf.optim.zero1.checkpoint import save_sharded

        save_sharded(self.zero1, output_dir, save_serially)

    def load_sharded_state_dict(self, output_dir: str, num_workers_per_step: int = 8) -> None:
        """Read the state ``save_sharded_state_dict`` wrote (parameters included), at most
        ``num_workers_per_step`` ranks at a time."""
        from nxd_hf.optim.zero1.checkpoint import load_sharded

        load_sharded(self.zero1, output_dir, num_workers_per_step)

    # -- the checkpoint's optimizer-state protocol
    def param_states(self) -> ParamStates:
        """Each parameter's state in its local layout: the slices held by the DP ranks are summed
        into it (each element comes from one rank), one parameter at a time. Collective."""
        out = {}
        for index, (fg, master) in enumerate(zip(self.zero1.flat_groups, self.zero1.masters)):
            flat, scalars = self._slice_state(index)
            group = self.zero1.group_of(fg)
            keys = sorted(backend.all_gather_object(sorted(flat), group), key=len)[-1]
            sources = {key: flat.get(key) for key in keys}
            if fg.dtype != torch.float32:
                sources[MASTER] = master.detach()
            scalar_keys = sorted(backend.all_gather_object(sorted(scalars), group), key=len)[-1]
            for i, param in enumerate(fg.params):
                state = {}
                for key, source in sources.items():
                    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
                    for a, b, at in (fg.param_pieces(i) if source is not None else ()):
                        full[a:b] = source[at : at + b - a]
                    backend.all_reduce(full, group)
                    state[key] = full.view(param.shape)
                state.update({key: _agreed_scalar(scalars.get(key), group) for key in scalar_keys})
                out[id(param)] = (param, state)
        return out

    def _slice_state(self, index: int) -> tuple[dict, dict]:
        """(per-element state over this rank's master slice ``index``, scalar state)."""
        chunks = self.zero1.optimizer.param_groups[index]["params"]
        states = [self.zero1.optimizer.state.get(c, {}) for c in chunks]
        flat, scalars = {}, {}
        for key, value in (states[0].items() if states else ()):
            if not isinstance(value, torch.Tensor):
                continue
            if value.numel() == chunks[0].numel() and value.dim() > 0:
                flat[key] = torch.cat([s[key].reshape(-1) for s in states])
            else:
                scalars[key] = value
        return flat, scalars

    def load_param_states(self, states: dict[int, dict]) -> None:
        """This rank's slice of each parameter's state (and of its master: the saved one, else
        the parameter) into the master slices and the inner optimizer."""
        keyed = []
        for index, (fg, master) in enumerate(zip(self.zero1.flat_groups, self.zero1.masters)):
            flat, scalars = {}, {}
            with torch.no_grad():
                for i, param in enumerate(fg.params):
                    pieces, state = fg.param_pieces(i), states.get(id(param), {})
                    src = state.get(MASTER, param).reshape(-1)
                    for a, b, at in pieces:
                        master[at : at + b - a] = src[a:b].float()
                    for key, value in state.items():
                        if key == MASTER:
                            continue
                        if value.dim() == 0 or value.numel() != param.numel():
                            scalars.setdefault(key, value)
                            continue
                        buffer = flat.setdefault(key, torch.zeros(fg.shard_numel, dtype=torch.float32,
                                                                  device=master.device))
                        for a, b, at in pieces:
                            buffer[at : at + b - a] = value.reshape(-1)[a:b]
            chunks = self.zero1.optimizer.param_groups[index]["params"]
            pieces = {key: buffer.split([c.numel() for c in chunks]) for key, buffer in flat.items()}
            keyed += [(c, {**{k: p[i].clone() for k, p in pieces.items()}, **{k: v.clone() for k, v in scalars.items()}})
                      for i, c in enumerate(chunks)]
        set_torch_state(self.zero1.optimizer, keyed)


def _agreed_scalar(value: torch.Tensor | None, group) -> torch.Tensor:
    """A scalar every DP rank holds equal (``step``); a rank without state holds none."""
    values = [v for v in backend.all_gather_object(value, group) if v is not None]
    return values[0].clone()
