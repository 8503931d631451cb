"""The reduce ops, and the reduction over ranks that collective tests compare against, computed in one process."""

import torch
import torch.distributed as dist

# The reduce ops by the names torch_tp's ops take, and c10d's for each.
REDUCE_OPS = ["sum", "avg", "min", "max", "product"]
C10D_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


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
