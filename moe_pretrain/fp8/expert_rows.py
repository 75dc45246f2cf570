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
