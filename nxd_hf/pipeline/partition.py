"""Partition rules (pure; unit-tested without processes).

A cut names a transformer layer, and that layer ends its stage. ``auto_partition`` splits the
layers evenly with the remainder on the later stages. There are P x V stages, placed as the
schedule needs: looped (stage s on rank s % P) or V-shaped for ZBV (rank r holds stages r and
2P - 1 - r).
"""

from typing import Literal

Placement = Literal["looped", "v_shape"]


def auto_cuts(layer_names: list[str], num_stages: int) -> list[str]:
    """Even split, remainder on the later stages: the last layer name of every stage but the last."""
    check_stage_count(len(layer_names), num_stages)
    base, extra = divmod(len(layer_names), num_stages)
    sizes = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
    cuts, end = [], 0
    for size in sizes[:-1]:
        end += size
        cuts.append(layer_names[end - 1])
    return cuts


def check_stage_count(num_layers: int, num_stages: int) -> None:
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} pipeline stages (pipeline_parallel_size x virtual_pipeline_size) but the model has only "
            f"{num_layers} transformer layers: use at most {num_layers} stages (a smaller pipeline_parallel_size)"
        )


def stage_of_layers(layer_names: list[str], cuts: list[str], num_stages: int) -> dict[str, int]:
    """Stage of every layer for explicit ``cuts`` (each cut ends its stage)."""
    check_stage_count(len(layer_names), num_stages)
    unknown = [c for c in cuts if c not in layer_names]
    if unknown:
        raise ValueError(
            f"pipeline_cuts {unknown} are not transformer layers of this model; cuts must name layers such as "
            f"{layer_names[0]!r} ... {layer_names[-1]!r}"
        )
    if len(cuts) != num_stages - 1:
        raise ValueError(f"{len(cuts)} pipeline_cuts give {len(cuts) + 1} stages, but {num_stages} are needed")
    positions = [layer_names.index(c) for c in cuts]
    if positions != sorted(set(positions)) or (positions and positions[-1] == len(layer_names) - 1):
        raise ValueError(
            f"pipeline_cuts {cuts} must be increasing and leave at least one layer for the last stage"
        )
    stages, stage = {}, 0
    for index, name in enumerate(layer_names):
        stages[name] = stage
        if stage < len(positions) and index == positions[stage]:
            stage += 1
    return stages


def stage_ranks(num_stages: int, pp_size: int, placement: Placement) -> list[int]:
    """PP rank of every stage."""
    if placement == "v_shape":
        assert num_stages == 2 * pp_size, "V-shaped placement needs exactly 2 stages per rank"
        return [s if s < pp_size else 2 * pp_size - 1 - s for s in range(num_stages)]
    return [s % pp_size for s in range(num_stages)]


def local_stages(num_stages: int, pp_size: int, pp_rank: int, placement: Placement) -> list[int]:
    return [s for s, r in enumerate(stage_ranks(num_stages, pp_size, placement)) if r == pp_rank]
