#!/usr/bin/env python3
"""A column -> GELU -> row tensor-parallel MLP block, forward + backward: torch_tp's linear ops vs DTensor TP vs
the bare GEMMs and all-reduces, on a gloo group (CPU, float32, one thread per rank)."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import harness
import torch_tp

IMPLS = ["torch_tp", "torch_tp_fused", "dtensor", "floor"]
NOOP_STEPS = 2000  # --noop-group: timed steps per implementation
# (batch, hidden): framework cost and latency (tiny GEMMs), the crossover, GEMM-bound: (timed repeats, warm-up steps)
REPEATS = {(8, 256): (400, 10), (128, 512): (120, 5), (512, 1024): (30, 2), (1024, 2048): (12, 1)}


def mlp_steps(batch: int, hidden: int, group: dist.ProcessGroup, mesh: DeviceMesh):
    """One forward + ``y.backward(grad_y)`` of each implementation on the same weights (same seed on every
    rank), and each one's untimed gradient reset. A step ends when y and x's gradient exist."""
    gen = torch.Generator().manual_seed(1234 + batch * 7 + hidden)
    ffn, name = 4 * hidden, group.group_name
    w1, b1 = torch.randn(ffn, hidden, generator=gen) / hidden**0.5, torch.randn(ffn, generator=gen) * 0.1
    w2, b2 = torch.randn(hidden, ffn, generator=gen) / ffn**0.5, torch.randn(hidden, generator=gen) * 0.1
    x, grad_y = torch.randn(batch, hidden, generator=gen), torch.randn(batch, hidden, generator=gen)
    shards = [torch_tp.ops.shard(w1, 0, group), torch_tp.ops.shard(b1, 0, group),
              torch_tp.ops.shard(w2, 1, group), b2.clone()]
    col, row = torch.ops.torch_tp.column_parallel_linear, torch.ops.torch_tp.row_parallel_linear
    tp, x_tp = [t.clone().requires_grad_() for t in shards], x.clone().requires_grad_()

    def step_tp():
        row(F.gelu(col(x_tp, tp[0], tp[1], name)), tp[2], tp[3], name).backward(grad_y)

    def step_tp_fused():
        row(col(x_tp, tp[0], tp[1], name, None, None, "gelu_tanh"), tp[2], tp[3], name).backward(grad_y)

    def reset_tp():
        for t in [x_tp, *tp]:
            t.grad = None

    # DTensor: the same weights in nn.Linear layers; src_data_rank=None: each rank keeps its own chunk.
    model = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    with torch.no_grad():
        for p, w in zip(model.parameters(), (w1, b1, w2, b2)):
            p.copy_(w)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}, src_data_rank=None)
    x_dt = x.clone().requires_grad_()

    def step_dt():
        y = model(x_dt)
        y.backward(grad_y)
        harness.materialize(x_dt.grad)
        return harness.materialize(y)

    def reset_dt():
        x_dt.grad = None
        model.zero_grad(set_to_none=True)

    # The floor: the same math by hand, no autograd, the all-reduces not overlapped (torch_tp may come in under).
    fw1, fb1, fw2, fb2 = shards

    def step_floor():
        pre = torch.addmm(fb1, x, fw1.t())
        h = F.gelu(pre)
        y = torch.mm(h, fw2.t())
        dist.all_reduce(y, group=group)
        y += fb2
        grads = [grad_y.sum(0), torch.mm(grad_y.t(), h)]  # b2, w2
        g_pre = torch.ops.aten.gelu_backward(torch.mm(grad_y, fw2), pre)
        grads += [torch.mm(g_pre.t(), x), g_pre.sum(0)]  # w1, b1
        g_x = torch.mm(g_pre, fw1)
        dist.all_reduce(g_x, group=group)
        return y, g_x, grads

    steps = {"torch_tp": step_tp, "torch_tp_fused": step_tp_fused, "dtensor": step_dt, "floor": step_floor}
    return steps, {"torch_tp": reset_tp, "torch_tp_fused": reset_tp, "dtensor": reset_dt}


def measure(args):
    group = harness.noop_group() if args.noop_group else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
    table = harness.Table("ms", IMPLS, ratios=[("dtensor", "torch_tp"), ("torch_tp", "floor"),
                                               ("torch_tp_fused", "floor")],
                          paired=[("torch_tp", "floor"), ("dtensor", "torch_tp")])
    sizes = list(REPEATS.items())
    for (batch, hidden), (repeats, warmup) in sizes[:1] if args.noop_group else sizes[:-1] if args.quick else sizes:
        steps, resets = mlp_steps(batch, hidden, group, mesh)
        if args.noop_group:  # batches of steps, the reset inside (a few attribute stores for every impl)
            batched = {k: (lambda s=s, r=resets.get(k, lambda: None): (r(), s())) for k, s in steps.items()}
            samples = harness.time_interleaved(batched, max(3, NOOP_STEPS // args.batch), calls=args.batch, warmup=2,
                                               order=harness.permutations(IMPLS), barrier="round")
        else:
            samples = harness.time_interleaved(steps, max(3, repeats // 10 if args.quick else repeats),
                                               order=harness.permutations(IMPLS), reset=resets,
                                               warmup=1 + (warmup // 3 if args.quick else warmup))
        row = table.add({"batch x hidden": f"{batch}x{hidden}"}, samples)
        for impl in ("torch_tp", "dtensor"):  # the target of the small size is per layer: a step is two layers
            row["extra"][f"{impl} per layer ms"] = row["stats"][impl]["median"] / 2
        del steps, resets
    return {
        "tag": "bench_linear", "stem": "linear",
        "title": "Linear layers: a column -> GELU -> row MLP block, torch_tp vs DTensor TP vs GEMMs + all-reduces",
        "about": "CPU float32, x [batch, hidden] -> Linear(hidden, 4 hidden) column-parallel -> GELU -> "
        "Linear(4 hidden, hidden) row-parallel (Megatron's MLP); a step is forward + `y.backward(grad_y)`. "
        "**torch_tp**: `torch.ops.torch_tp.column_parallel_linear` -> `F.gelu` -> `row_parallel_linear`; "
        "**torch_tp_fused**: the column op's `activation=\"gelu_tanh\"`; **dtensor**: the same `nn.Linear` pair "
        "under `parallelize_module` with ColwiseParallel / RowwiseParallel; **floor**: the same GEMMs by hand "
        "plus the two in-place all-reduces, no autograd. The order of the four cycles through all "
        "permutations; gradients reset untimed (on a no-op group: inside the batch).",
        "tables": [table]}


if __name__ == "__main__":
    sys.exit(harness.run(harness.parser(__doc__, quick="smoke run: a tenth of the repeats, without the largest "
                                        "size", noop_batch=50).parse_args(), measure))
