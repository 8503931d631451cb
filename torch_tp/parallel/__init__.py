"""Tensor-parallel module API, mirroring ``torch.distributed.tensor.parallel``."""

from .api import parallelize_module
from .checkpoint import clip_grad_norm_, get_full_state_dict, load_full_state_dict
from .loss import loss_parallel
from .style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "clip_grad_norm_",
    "get_full_state_dict",
    "load_full_state_dict",
    "loss_parallel",
    "parallelize_module",
]
