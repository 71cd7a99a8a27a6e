"""ZeRO-1's state on this rank (the optimizer state of its slice and the fp32 master slice):
state_dict / load_state_dict with a layout check, per-rank files, and its size in bytes."""

import torch


class Zero1StateMixin:
    """State methods of ``NeuronZero1Optimizer`` (needs its ``masters``, ``optimizer``,
    ``flat_groups``, ``param_groups``, ``dp_size``, ``dp_rank`` and ``sharding_group``)."""

    def optimizer_state_bytes(self) -> int:
        """Bytes of this rank's per-element state: the fp32 master slices plus every state
        tensor of the master slices' size (Adam's exp_avg, exp_avg_sq; not scalar step counts)."""
        total = sum(m.numel() * m.element_size() for m in self.masters)
        for group in self.optimizer.param_groups:
            for chunk in group["params"]:
                for value in self.optimizer.state[chunk].values():
                    if isinstance(value, torch.Tensor) and value.numel() == chunk.numel():
                        total += value.numel() * value.element_size()
        return total

    def layout(self) -> dict:
        """What a saved shard must match to be loaded here."""
        return {
            "dp_size": self.dp_size, "dp_rank": self.dp_rank,
            "chunks": [len(group["params"]) for group in self.optimizer.param_groups],
            "groups": [{"group_index": fg.group_index, "dtype": str(fg.dtype), "numel": fg.numel,
                        "shard_numel": fg.shard_numel, "shapes": [list(p.shape) for p in fg.params]}
                       for fg in self.flat_groups],
        }

    def state_dict(self) -> dict:
        """This rank's shard: inner optimizer state, fp32 master slices, param group options
        and the layout they belong to."""
        return {
            "layout": self.layout(),
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups],
            "masters": [m.detach().clone() for m in self.masters],
            "inner": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        saved, here = state_dict["layout"], self.layout()
        if saved != here:
            diff = [k for k in here if saved.get(k) != here[k]]
            raise ValueError(
                f"this ZeRO-1 shard was saved for another layout (differs in {diff}): load it with the same "
                "data/tensor/pipeline parallel sizes, parameters and param groups it was saved with")
        self.optimizer.load_state_dict(state_dict["inner"])
        for master, saved_master in zip(self.masters, state_dict["masters"]):
            master.copy_(saved_master)
        for group, options in zip(self.param_groups, state_dict["param_groups"]):
            group.update(options)

    def save_sharded_state_dict(self, output_dir: str, save_serially: bool = True) -> None:
        """Write this optimizer's state under ``output_dir`` in nxd_hf's checkpoint format (it
        loads at other DP/TP sizes); ``save_serially``: one rank writes at a time."""
        from nxd_hf.checkpoint.zero1_shards import save_sharded

        save_sharded(self, output_dir, save_serially)

    def load_sharded_state_dict(self, output_dir: str, num_workers_per_step: int = 8) -> None:
        """Read the state ``save_sharded_state_dict`` wrote (parameters included), at most
        ``num_workers_per_step`` ranks at a time."""
        from nxd_hf.checkpoint.zero1_shards import load_sharded

        load_sharded(self, output_dir, num_workers_per_step)
