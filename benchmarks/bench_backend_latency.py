#!/usr/bin/env python3
"""The torch_tp backend at the latency limit: against DeepSpeed's CPU shared-memory all-reduce and gloo.

DeepSpeed is a peer, never a dependency: without it (or where its op does not build, or the CPU lacks the
ISA its kernels need) its columns are left empty and the section says why.
"""

import os
import sys

# DeepSpeed sets up shared memory only when these are set before it is imported (torchrun sets neither).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import harness  # noqa: E402
from harness import ALL_GATHER, KiB, MiB, REDUCE_SCATTER  # noqa: E402

SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IMPLS = ["tp dist", "tp op", "tp op_", "ds", "ds raw", "gloo", "all_gather tp dist", "all_gather tp op",
         "reduce_scatter tp dist", "reduce_scatter tp op"]


def calls_per_sample(size: int) -> int:
    return 100 if size <= 64 * KiB else 10 if size <= MiB else 1


def deepspeed_ops(p: int):
    """``(inference_all_reduce, its raw op, what)``, or ``(None, None, why not)``, the same on every rank."""
    try:
        import deepspeed
        import deepspeed.comm as ds_comm

        if os.environ["LOCAL_SIZE"] != str(p):
            raise RuntimeError(f"LOCAL_SIZE={os.environ['LOCAL_SIZE']} is not the world size {p}: no shared memory")
        deepspeed.init_distributed(dist_backend="gloo")
        backend = ds_comm.comm.cdb
        if getattr(backend, "shm_comm_op", None) is None:
            raise RuntimeError("DeepSpeed's deepspeed_shm_comm op did not build")
        if getattr(backend, "shm_vector_kernel_level", 0) < 2:
            raise RuntimeError("the CPU lacks avx512bw, which DeepSpeed's bf16 shm kernel needs")
        ds = (ds_comm.inference_all_reduce, torch.ops.deepspeed.inference_all_reduce_,
              f"DeepSpeed {deepspeed.__version__}")
    except Exception as e:  # not installed, or unusable here
        ds = (None, None, f"DeepSpeed skipped ({type(e).__name__}: {e})")
    ok = torch.tensor([0 if ds[0] is None else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return ds if ok.item() else (None, None, ds[2] if ds[0] is None else "DeepSpeed skipped (unusable on another rank)")


def steps(dtype: torch.dtype, size: int, tp, ds_call, ds_raw):
    """Every implementation of one (dtype, size), each on buffers of its own (in-place sums of zeros stay
    zero). ``tp dist``: `dist.*` on the torch_tp group; ``tp op``: the functional torch_tp op (a fresh
    output); ``tp op_``: the in-place one, DeepSpeed's raw op's like-for-like."""
    p, name = tp.size(), tp.group_name
    numel = size // dtype.itemsize
    numel -= numel % p
    buf = {k: torch.zeros(numel, dtype=dtype) for k in ("tp dist", "tp op", "tp op_", "gloo", "ds", "ds raw")}
    shard, full = torch.zeros(numel // p, dtype=dtype), torch.zeros(numel, dtype=dtype)
    gathered, scattered = torch.empty(numel, dtype=dtype), torch.empty(numel // p, dtype=dtype)
    out = {
        "tp dist": lambda: dist.all_reduce(buf["tp dist"], group=tp),
        "tp op": lambda: torch.ops.torch_tp.all_reduce(buf["tp op"], "sum", name),
        "tp op_": lambda: torch.ops.torch_tp.all_reduce_(buf["tp op_"], "sum", name),
        "gloo": lambda: dist.all_reduce(buf["gloo"]),
        "all_gather tp dist": lambda: ALL_GATHER(gathered, shard, group=tp),
        "all_gather tp op": lambda: torch.ops.torch_tp.all_gather(shard, 0, name, None),
        "reduce_scatter tp dist": lambda: REDUCE_SCATTER(scattered, full, group=tp),
        "reduce_scatter tp op": lambda: torch.ops.torch_tp.reduce_scatter(full, 0, "sum", name),
    }
    if ds_call is not None:
        out["ds"] = lambda: ds_call(buf["ds"])
        out["ds raw"] = lambda: ds_raw(buf["ds raw"])
    return out


def breakdown(tp, rounds: int, ds_raw) -> harness.Table:
    """A 4 KiB float32 all-reduce by layer, in the same rounds: torch's Python c10d wrapper, dispatcher and
    Work alone (no-op group), one transport step without data (barrier), the call handed to the worker
    thread (async + wait), the inline call, the ops (direct calls into the backend), and what any
    functional op called through torch.ops pays before it communicates (aten.clone)."""
    fake = harness.noop_group()
    t = {k: torch.zeros(1024) for k in ("fake", "sync", "async", "ds raw", "clone")}
    parts = {
        "torch_tp barrier": lambda: dist.barrier(group=tp),
        "tp dist async_op=True + wait": lambda: dist.all_reduce(t["async"], group=tp, async_op=True).wait(),
        "tp dist": lambda: dist.all_reduce(t["sync"], group=tp),
        "tp op": lambda: torch.ops.torch_tp.all_reduce(t["sync"], "sum", tp.group_name),
        "tp op_": lambda: torch.ops.torch_tp.all_reduce_(t["sync"], "sum", tp.group_name),
        "aten.clone through torch.ops (no communication)": lambda: torch.ops.aten.clone(t["clone"]),
        "no-op group dist.all_reduce": lambda: dist.all_reduce(t["fake"], group=fake),
    }
    if ds_raw is not None:
        parts["ds raw"] = lambda: ds_raw(t["ds raw"])
    samples = harness.time_interleaved(parts, rounds, calls=calls_per_sample(4 * KiB), warmup=1,
                                       barrier=lambda key: dist.barrier(group=tp))
    table = harness.Table("us", list(parts), title="4 KiB float32 all-reduce by layer (same rounds)")
    table.add({"what": "4 KiB float32"}, samples)
    return table


def measure(args):
    p = dist.get_world_size()
    load_start = os.getloadavg()
    tp = dist.new_group(backend="torch_tp")
    ds_call, ds_raw, peer = deepspeed_ops(p)
    rounds = lambda size: 5 if args.quick else 15 if size <= MiB else 7  # noqa: E731
    tables = [] if args.no_breakdown else [breakdown(tp, rounds(4 * KiB), ds_raw)]
    table = harness.Table("us", IMPLS, ratios=[("ds", "tp dist"), ("ds raw", "tp op"), ("ds raw", "tp op_")],
                          title="us per call")
    for size in args.sizes:
        for dtype_name in args.dtypes:
            samples = harness.time_interleaved(steps(DTYPES[dtype_name], size, tp, ds_call, ds_raw), rounds(size),
                                               calls=calls_per_sample(size), warmup=1,
                                               barrier=lambda key: dist.barrier(group=tp))
            table.add({"dtype": dtype_name, "size": harness.fmt_size(size)}, samples, x=size, panel=dtype_name)
            if dist.get_rank() == 0:
                print(f"[bench_backend_latency] {dtype_name} {harness.fmt_size(size)} done", flush=True)
    return {
        "tag": f"bench_backend_latency ws={p}", "stem": f"backend_latency_ws{p}",
        "title": f"The torch_tp backend against DeepSpeed's shm all-reduce and gloo, {p} ranks",
        "about": f"Peers: {peer}. All-reduce: **tp dist** `dist.all_reduce` on a torch_tp group, **tp op** "
        "`torch.ops.torch_tp.all_reduce` (functional), **tp op_** `torch.ops.torch_tp.all_reduce_` (in place), "
        "**ds** `deepspeed.comm.inference_all_reduce`, **ds raw** `torch.ops.deepspeed.inference_all_reduce_`, "
        f"**gloo** `dist.all_reduce`; all_gather and reduce_scatter through `dist.{ALL_GATHER.__name__}` / "
        f"`{REDUCE_SCATTER.__name__}` and the ops (DeepSpeed has none: compare with its same-size all-reduce). "
        "Every column of a row in the same rounds, rotating; a sample is a batch of back-to-back calls (100 up "
        "to 64 KiB, 10 up to 1 MiB, else 1) after a torch_tp barrier.",
        "tables": tables + [table],
        "notes": ["Load average (1, 5, 15 min) at the start: {:.1f}, {:.1f}, {:.1f}; at the end: {:.1f}, {:.1f}, "
                  "{:.1f} (the machine is shared).".format(*load_start, *os.getloadavg())],
    }


if __name__ == "__main__":
    p = harness.parser(__doc__, quick="smoke run: five rounds per row")
    p.add_argument("--no-breakdown", action="store_true",
                   help="skip the 4 KiB by-layer table (it needs torch's fake backend for its no-op group row)")
    p.add_argument("--sizes", type=harness.sizes, default=SIZES,
                   help="comma-separated sizes, e.g. 4K,64K (default: 4 KiB, 64 KiB, 1 MiB, 16 MiB)")
    p.add_argument("--dtypes", type=harness.names(DTYPES), default="float32,bfloat16",
                   help=f"comma-separated, of {', '.join(DTYPES)} (default: %(default)s)")
    sys.exit(harness.run(p.parse_args(), measure))
