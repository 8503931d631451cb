#!/usr/bin/env python3
"""What handing a DTensor from one tensor-parallel module to the next costs, per call (CPU, eager): where a plan asks
for DTensors between modules (SequenceParallel's output, PrepareModuleInput's with ``use_local_output=False``), one
module wraps its local result and the next takes the local tensor back. No data moves. The forward only: torch's handoff
also adds two autograd nodes to the backward, torch_tp's none (NOTE [DTensors handed between torch_tp modules])."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import harness
from torch_tp.parallel._layout import contiguous_stride, from_dtensor, to_dtensor, tp_group

IMPLS = ["torch_tp", "dtensor", "floor"]


def measure(args):
    p, placement, (batch, repeats) = dist.get_world_size(), Shard(1), (200, 5) if args.quick else (2000, 30)
    mesh, global_shape = init_device_mesh("cpu", (p,)), torch.Size((4, 32 * p, 256))
    tp, stride = tp_group(mesh), contiguous_stride(global_shape)
    table = harness.Table("us", IMPLS, ratios=[("dtensor", "torch_tp")],
                          paired=[("torch_tp", "floor"), ("dtensor", "floor")])
    for requires_grad in (True, False):
        local = torch.randn(4, 32, 256, requires_grad=requires_grad)

        def torch_tp_handoff():
            handed = to_dtensor(local, mesh, placement, global_shape)
            return from_dtensor(handed, placement, tp)[0]

        def dtensor_handoff():
            dt = DTensor.from_local(local, mesh, (placement,), run_check=False, shape=global_shape, stride=stride)
            return dt.to_local()

        assert all(out.shape == local.shape and out.data_ptr() == local.data_ptr()
                   for out in (torch_tp_handoff(), dtensor_handoff()))
        samples = harness.time_interleaved({"torch_tp": torch_tp_handoff, "dtensor": dtensor_handoff,
                                            "floor": lambda: local}, repeats, calls=batch, warmup=2, barrier="round",
                                           order=harness.permutations(IMPLS))
        table.add({"requires_grad": requires_grad}, samples)
    return {
        "tag": "bench_handoff", "stem": "handoff",
        "title": "Handing a DTensor between modules: torch_tp vs DTensor",
        "about": f"CPU, eager, {p} ranks, one intra-op thread. Per call: wrap a local sequence shard [4, 32, 256] as "
        "a Shard(1) DTensor and take the local tensor back, as the module after a SequenceParallel or "
        "PrepareModuleInput does. **torch_tp**: `to_dtensor` then `from_dtensor` (torch_tp/parallel/_layout.py); "
        "**dtensor**: `DTensor.from_local(run_check=False, shape=, stride=)` then `to_local()`, as torch's styles; "
        f"**floor**: the tensor handed on as it is. Samples of {batch} back-to-back calls (the forward only).",
        "tables": [table]}


if __name__ == "__main__":
    sys.exit(harness.run(harness.parser(__doc__, quick="smoke run: few repeats, short batches").parse_args(), measure))
