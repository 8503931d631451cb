#!/usr/bin/env python3
"""The torch_tp process-group backend against gloo on one machine: latency and bus bandwidth (a section for each
world size: run it with --nproc-per-node 2 and 4)."""

import os
import sys
import time

import torch
import torch.distributed as dist

import harness
from harness import KiB, MiB

SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB]
OPS = ["all_reduce", "all_gather", "reduce_scatter"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS = ["gloo", "torch_tp"]


def collective(op: str, dtype: torch.dtype, size: int, group):
    """One call of ``op`` on preallocated buffers; ``size`` is nccl-tests' S: the all_reduce tensor, the
    all_gather output, the reduce_scatter input."""
    p = group.size()
    numel = size // dtype.itemsize
    numel -= numel % p
    full, piece = torch.randn(numel).to(dtype), torch.empty(numel // p, dtype=dtype)
    if op == "all_reduce":  # in place on the same buffer: the values grow, the time does not
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, piece, group=group)
    return lambda: dist.reduce_scatter_tensor(piece, full, group=group)


def memcpy_GBps() -> float:
    """Single-core memcpy, the physical limit: 16 MiB ``copy_`` on rank 0 while the others wait, bytes
    copied per second, the median of 20 after warm-up."""
    value = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        src = torch.randn(4 * MiB)
        dst = torch.empty_like(src)
        times = []
        for i in range(25):
            start = time.perf_counter()
            dst.copy_(src)
            if i >= 5:
                times.append(time.perf_counter() - start)
        value[0] = 16 * MiB / harness.quantile(times, 0.5) / 1e9
    dist.broadcast(value, src=0)
    return value.item()


def measure(args):
    p = dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "torch_tp": dist.new_group(backend="torch_tp")}
    memcpy = memcpy_GBps()
    table = harness.Table("us", BACKENDS, ratios=[("gloo", "torch_tp")])
    for size in QUICK_SIZES if args.quick else SIZES:
        for op in OPS:
            for dtype_name, dtype in DTYPES.items():
                calls = {name: collective(op, dtype, size, g) for name, g in groups.items()}
                # batches long enough for the clock at small S; a barrier on the group being timed
                samples = harness.time_interleaved(
                    calls, 3 if args.quick else 30 if size <= MiB else 15 if size <= 16 * MiB else 7,
                    calls=20 if size <= 64 * KiB else 5 if size <= MiB else 1, warmup=1,
                    barrier=lambda name: dist.barrier(group=groups[name]))
                bw = {name: harness.busbw_GBps(op, size, samples.median(name, "s"), p) for name in BACKENDS}
                table.add({"op": op, "dtype": dtype_name, "size": harness.fmt_size(size)}, samples,
                          x=size, panel=f"{op} {dtype_name}",
                          extra={"gloo busbw GB/s": bw["gloo"], "torch_tp busbw GB/s": bw["torch_tp"],
                                 "torch_tp busbw / memcpy": bw["torch_tp"] / memcpy})
        if dist.get_rank() == 0:
            print(f"[bench_backend] {harness.fmt_size(size)} done", flush=True)
    return {
        "tag": f"bench_backend ws={p}", "stem": f"backend_ws{p}",
        "title": f"The torch_tp backend against gloo, {p} ranks on one machine",
        "about": "Both backends in one job: the default gloo group and `dist.new_group(backend=\"torch_tp\")` "
        "over the same ranks, alternating within each repeat. `dist.all_reduce` (in place), "
        "`all_gather_into_tensor`, `reduce_scatter_tensor`; size S as nccl-tests: the all_reduce tensor, the "
        "all_gather output, the reduce_scatter input; busbw = S/t x 2(p-1)/p (all_reduce) or (p-1)/p. A "
        "sample is a batch of 20 calls up to 64 KiB, 5 up to 1 MiB, else 1.",
        "memcpy_GBps": memcpy, "buffer_bytes_env": os.environ.get("TORCH_TP_SHM_BUFFER_BYTES"),
        "tables": [table],
        "notes": [f"Single-core memcpy bandwidth, same run: **{memcpy:.2f} GB/s** (16 MiB `copy_`, median)."],
    }


if __name__ == "__main__":
    sys.exit(harness.run(harness.parser(__doc__, quick="smoke run: four sizes, three repeats").parse_args(), measure))
