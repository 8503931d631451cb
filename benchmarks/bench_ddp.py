#!/usr/bin/env python3
"""Data-parallel training steps: torch_tp.DistributedDataParallel against torch's DDP, same backend, over a
sweep of bucket caps (CPU, float32, one thread per rank)."""

import contextlib
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import harness
import torch_tp

IMPLS = ["torch_tp", "torch"]
BUCKET_MB = [1.0, 5.0, 25.0, 100.0]


def measure(args):
    torch.manual_seed(0)
    layers, dim = (4, 512) if args.quick else (8, 1536)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.GELU())])
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(32, dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    table = harness.Table("ms", IMPLS + [f"{i} compute" for i in IMPLS] + ["comm"], ratios=[("torch", "torch_tp")])
    for cap in BUCKET_MB:
        wrapped = {"torch_tp": torch_tp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap),
                   "torch": torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap)}

        def step(ddp, sync=True):  # ends when every .grad holds the average: both reducers wait inside backward
            for p in ddp.parameters():
                p.grad = None
            with contextlib.nullcontext() if sync else ddp.no_sync():  # no_sync: the compute alone
                ddp(x).square().mean().backward()

        for ddp in wrapped.values():  # warm-up; the buckets are rebuilt after the first step
            step(ddp)
            step(ddp)
        # the communication alone: the model's gradient size all-reduced in buckets of the cap, all started, then waited
        buckets = list(torch.zeros(numel).split(max(1, int(cap * 1024 * 1024) // 4)))

        def comm():
            for work in [dist.all_reduce(b, async_op=True) for b in buckets]:
                work.wait()

        steps = {"comm": comm}
        for impl, ddp in wrapped.items():
            steps[impl] = lambda ddp=ddp: step(ddp)
            steps[f"{impl} compute"] = lambda ddp=ddp: step(ddp, sync=False)
        rotate = harness.rotations(IMPLS)
        samples = harness.time_interleaved(steps, args.repeats, order=lambda r: rotate(r) + [
            f"{i} compute" for i in rotate(r)] + ["comm"])
        med = {k: samples.median(k, "ms") for k in steps}
        # the share of the all-reduce time hidden behind backward (1: all; < 0: the step costs more than both in turn)
        hidden = {f"{i} hidden": f"{(med[f'{i} compute'] + med['comm'] - med[i]) / med['comm']:.0%}" for i in IMPLS}
        table.add({"bucket cap": f"{cap:g} MiB", "buckets": len(wrapped["torch_tp"].reducer.bucket_indices())},
                  samples, extra=hidden)
        del wrapped
    suffix = "" if args.backend == "gloo" else f"_{args.backend}"
    return {
        "tag": f"bench_ddp{suffix}", "stem": f"ddp{suffix}",
        "title": f"Data parallel: torch_tp.DistributedDataParallel vs torch DDP ({args.backend})",
        "about": f"Model: {layers} x (Linear({dim}, {dim}) + GELU), {numel / 1e6:.1f} M fp32 "
        "parameters, batch 32 per rank; deep copies of one model in both wrappers. A step is forward, "
        "loss, backward until every gradient is averaged; `compute`: the same under `no_sync()`; `comm`: the "
        "model's gradient size all-reduced in buckets of the cap; hidden = (compute + comm - step) / comm. Per "
        "repeat both steps (order alternating), both compute-only steps, then comm.",
        "tables": [table]}


if __name__ == "__main__":
    p = harness.parser(__doc__, quick="smoke run: 4 x 512 layers, 3 repeats", backend="gloo")
    p.add_argument("--repeats", type=int, default=9, help="timed repeats per bucket cap (default: %(default)s)")
    args = p.parse_args()
    args.repeats = 3 if args.quick else args.repeats
    sys.exit(harness.run(args, measure))
