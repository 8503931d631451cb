"""The reduction over ranks that collective tests compare against, computed in one process."""

import torch


def reduce_reference(stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """Reduce ``stacked`` [p, ...] over dim 0: floats in float64, integers in
    int64, bool as logical or (sum, max) / and (min, product)."""
    if stacked.dtype == torch.bool:
        return stacked.any(0) if reduce_op in ("sum", "max") else stacked.all(0)
    wide = stacked.double() if stacked.dtype.is_floating_point else stacked.long()
    if reduce_op == "sum":
        return wide.sum(0)
    if reduce_op == "avg":
        return wide.mean(0)
    if reduce_op == "min":
        return wide.amin(0)
    if reduce_op == "max":
        return wide.amax(0)
    return wide.prod(0)
