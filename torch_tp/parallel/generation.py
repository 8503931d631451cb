"""``generation_layouts``: run a model parallelized for training the way generation needs it.

NOTE [generating under a sequence-parallel or loss_parallel plan]
Two plans that train well cannot generate as they are, in torch as in torch_tp:

* A ``loss_parallel`` plan hands the output projection's logits back as a
  ``Shard(-1)`` DTensor (``ColwiseParallel(use_local_output=False)``), for
  ``loss_parallel`` to consume. ``generate()`` consumes them with plain
  tensors (its next-token arithmetic, ``where`` and ``argmax`` against the
  plain ``input_ids``), and DTensor refuses the mix ("got mixed torch.Tensor
  and DTensor"). Even a DTensor-only consumer would only get the argmax of a
  class-sharded tensor by an all-gather that DTensor adds implicitly.
* A sequence-parallel plan (torchtitan's: the embedding reduce-scatters along
  the sequence, norms run on sequence shards, ``PrepareModuleInput`` gathers
  before attention and MLP) with local outputs hands the model's own code a
  sequence shard: HF's models take the positions, the cache position and the
  causal mask from the embedding's output, so they see 3 of 7 tokens, and a
  1-token decode step has no sequence to split (a rank's piece would be
  empty).

Neither is a property of the parameters: the same DTensor weights compute
generation with every activation's sequence replicated, which is plain
tensor parallelism. So torch_tp does not ask for a second plan (re-running
``parallelize_module`` would need a fresh model and a checkpoint round trip)
and does not change what the styles return by guessing a caller
(``loss_parallel`` may be entered after the forward, so a style cannot tell
a training forward from a generation step). Inside
``with generation_layouts(model):``, for the torch_tp modules of ``model``:

* every layout the plan gives an activation as ``Shard(d)`` on a dim other
  than the last (the features) is taken as ``Replicate()``: the embedding and
  the row-parallel layers all-reduce instead of reduce-scattering,
  ``SequenceParallel`` modules run on the whole sequence, and
  ``PrepareModuleInput``/``Output`` and column-parallel inputs have nothing to
  gather. A ``Shard(d)`` DTensor input still counts by its own placement;
* a ``ColwiseParallel(use_local_output=False)`` output sharded on its last
  dim (``loss_parallel``'s logits) is all-gathered and handed back as a plain
  tensor, as a ``ColwiseParallel(output_layouts=Replicate())`` would.

Layouts sharded on the features (column-/row-parallel weights, heads) and
every parameter stay as they are: the checkpoint, the KV cache's per-rank
heads and the compute per rank are those of tensor parallelism without
sequence parallelism. Outside the block, nothing changes, so training keeps
its numbers. The block is for inference: a ``SequenceParallel`` module
refuses to run inside it with gradients enabled, because each rank's
parameter gradient would cover the whole sequence and be summed over the
ranks. The switch is a flag on the records the torch_tp modules below a
parallelized root share (``ForwardRecords``), read on every forward; the
ranks must enter and leave the block alike, as they run the same program.
"""

import contextlib
from typing import Dict, Iterator

import torch.nn as nn

from ._layout import ForwardRecords

__all__ = ["generation_layouts"]


@contextlib.contextmanager
def generation_layouts(model: nn.Module) -> Iterator[nn.Module]:
    r"""Run ``model``, parallelized for training, as generation needs it (NOTE [generating under a
    sequence-parallel or loss_parallel plan]).

    Inside the block, sequence-parallel layouts of ``model``'s plan are replicated (so a
    prompt of any length and a 1-token decode step work, and HF's models see the whole
    sequence) and ``loss_parallel``'s ``Shard(-1)`` DTensor logits come back as plain full
    tensors. Parameters are untouched. For inference (``generate()`` runs under
    ``torch.no_grad()``); every rank must enter it.

    Args:
        model (nn.Module): a module parallelized with :func:`parallelize_module` (or one
            containing such modules).

    Returns:
        ``model``, for ``with generation_layouts(model) as m: m.generate(...)``.

    Example::

        >>> # xdoctest: +SKIP("distributed")
        >>> parallelize_module(model, tp_mesh, sp_and_loss_parallel_plan)   # trained with it
        >>> with torch_tp.parallel.generation_layouts(model):
        ...     tokens = model.generate(ids, max_new_tokens=32, do_sample=False)
    """
    records: Dict[int, ForwardRecords] = {}
    for module in model.modules():
        state = getattr(module, "_tp_state", None)
        if state is not None:
            records[id(state.records)] = state.records
    if not records:
        raise ValueError(f"torch_tp.parallel.generation_layouts: {type(model).__name__} has no module parallelized "
                         "by torch_tp.parallelize_module")
    previous = {key: value.replicate_sequence for key, value in records.items()}
    for value in records.values():
        value.replicate_sequence = True
    try:
        yield model
    finally:
        for key, value in records.items():
            value.replicate_sequence = previous[key]
