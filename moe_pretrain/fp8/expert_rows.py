"""Per-expert facts of rows grouped by expert, computed on the device (no host read of the counts): which
expert each row belongs to and each expert's amax, for the grouped FP8 engines that take counts as offsets."""

import torch


def expert_of_rows(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """[R] int64: the expert of each row (counts [E] rows of expert e, in order). output_size keeps the
    repeat on the device."""
    experts = torch.arange(counts.shape[0], device=counts.device)
    return torch.repeat_interleave(experts, counts, output_size=rows)


def expert_amax(x_RI: torch.Tensor, experts_R: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] fp32: the largest |x| over each expert's rows (0 for an expert with none)."""
    row_amax = x_RI.detach().abs().amax(dim=1).float() if x_RI.shape[1] else x_RI.new_zeros(x_RI.shape[0]).float()
    return row_amax.new_zeros(num_experts).scatter_reduce(0, experts_R, row_amax, "amax")


def padded_groups(counts: torch.Tensor, rows: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each expert's rows moved to a group padded to a multiple of `multiple` rows (FP8 grouped GEMMs contract
    over the rows in the weight gradient and want every group aligned, as Megatron pads its routing for FP8):
    (index [R]: the padded row of each row, padded group ends [E] int32, a row count that holds them all:
    R + E * (multiple - 1), known without reading the counts). Device operations only."""
    padded = (counts + multiple - 1) // multiple * multiple
    padded_ends = torch.cumsum(padded, 0)
    shift = (padded_ends - padded) - (torch.cumsum(counts, 0) - counts)  # padded start - start, per expert
    index = torch.arange(rows, device=counts.device) + shift[expert_of_rows(counts, rows)]
    return index, padded_ends.to(torch.int32), rows + counts.shape[0] * (multiple - 1)


def scatter_rows(x: torch.Tensor, index: torch.Tensor, rows: int, fill: float = 0.0) -> torch.Tensor:
    """[R, ...] -> [rows, ...]: x's rows at `index`, `fill` elsewhere (the padding of padded_groups)."""
    out = x.new_full((rows, *x.shape[1:]), fill)
    out[index] = x
    return out
