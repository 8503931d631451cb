#!/usr/bin/env python3
"""Collectives on one machine, three comparisons, a section each:

- torch_tp's collective ops against torch's functional collectives and raw c10d (CPU, float32; size: the
  per-rank input). With ``--dim 1`` the all-gather and reduce-scatter run along dim 1 of a [4, n] input, as a
  sequence-parallel gather of [b, s, h] runs along s; raw c10d, which has no dim, moves the same bytes along
  dim 0 (the floor).
- ``--vs-gloo``: the torch_tp process-group backend against gloo, latency and bus bandwidth (size: nccl-tests'
  S; a section for each world size: run it with --nproc-per-node 2 and 4).
- ``--latency``: the torch_tp backend at the latency limit, against DeepSpeed's CPU shared-memory all-reduce
  and gloo. DeepSpeed is a peer, never a dependency: without it (or where its op does not build, or the CPU
  lacks the ISA its kernels need) its columns are left empty and the section says why.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import harness

KiB, MiB = 1024, 1024 * 1024
# torch 2.13 deprecated all_gather_into_tensor / reduce_scatter_tensor (a warning every call): the new names.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
FC_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
FC_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
OPS = ["all_reduce", "all_gather", "reduce_scatter"]
IMPLS = ["torch_tp", "functional", "raw"]
SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
NOOP_SIZES = [64, 4 * KiB, 64 * KiB]
FEW_SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB]  # --latency's, and --vs-gloo --quick's
# Timed repeats by size: many where a call is short and noisy, few where one takes tens of ms; --quick: a tenth.
REPEATS = {4 * KiB: 400, 16 * KiB: 400, 64 * KiB: 300, 256 * KiB: 200, MiB: 120, 4 * MiB: 60, 16 * MiB: 30,
           64 * MiB: 15}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NOOP_CALLS = 5000  # --noop-group: timed calls per size, op and implementation
BACKENDS = ["gloo", "torch_tp"]
LATENCY_IMPLS = ["tp dist", "tp op", "tp op_", "ds", "ds raw", "gloo", "all_gather tp dist", "all_gather tp op",
                 "reduce_scatter tp dist", "reduce_scatter tp op"]


def fmt_size(n: int) -> str:
    return next((f"{n // u} {name}" for u, name in ((MiB, "MiB"), (KiB, "KiB")) if n >= u and n % u == 0), f"{n} B")


def sizes(text: str):
    """Comma-separated sizes, each ``4K``, ``1M`` or a byte count."""
    return [int(v[:-1]) * {"K": KiB, "M": MiB}[v[-1].upper()] if v[-1] in "KkMm" else int(v) for v in text.split(",")]


def busbw_GBps(op: str, nbytes: int, seconds: float, p: int) -> float:
    """nccl-tests' bus bandwidth, GB/s: ``S / t`` times 2(p-1)/p for all_reduce, (p-1)/p for all_gather and
    reduce_scatter (S: the all_reduce tensor, the all_gather output, the reduce_scatter input)."""
    return nbytes / seconds / 1e9 * (2 * (p - 1) / p if op == "all_reduce" else (p - 1) / p)


def repeats(nbytes: int, args) -> int:
    n = REPEATS[min((s for s in REPEATS if s >= nbytes), default=max(REPEATS))]
    return max(3, n // 10 if args.quick else n)


def steps(op: str, nbytes: int, group: dist.ProcessGroup, dim: int):
    """The three implementations of one op, the untimed reset and the full tensor's bytes for bus bandwidth.
    The raw call writes into buffers made here (the communication alone); the others allocate their outputs.
    ``dim``: torch_tp's and the functional all-gather's and reduce-scatter's dim of a [4, n] input."""
    world, name = group.size(), group.group_name
    x = torch.rand(nbytes // 4)
    shaped = x.view(4, -1) if dim else x
    wait = lambda y: y.wait() if isinstance(y, funcol.AsyncCollectiveTensor) else funcol.wait_tensor(y)  # noqa
    if op == "all_reduce":
        buf = x.clone()  # in place: refilled before every sample, or the sums grow to inf
        return {"torch_tp": lambda: torch.ops.torch_tp.all_reduce(x, "sum", name),
                "functional": lambda: wait(funcol.all_reduce(x, "sum", group)),
                "raw": lambda: dist.all_reduce(buf, group=group)}, lambda: buf.copy_(x), nbytes
    if op == "all_gather":
        out = torch.empty(x.numel() * world)
        return {"torch_tp": lambda: torch.ops.torch_tp.all_gather(shaped, dim, name),
                "functional": lambda: wait(FC_ALL_GATHER(shaped, dim, group)),
                "raw": lambda: ALL_GATHER(out, x, group=group)}, None, nbytes * world
    out = torch.empty(x.numel() // world)
    return {"torch_tp": lambda: torch.ops.torch_tp.reduce_scatter(shaped, dim, "sum", name),
            "functional": lambda: wait(FC_REDUCE_SCATTER(shaped, "sum", dim, group)),
            "raw": lambda: REDUCE_SCATTER(out, x, group=group)}, None, nbytes


def overhead(args):
    group = harness.noop_group() if args.noop_group else dist.group.WORLD
    p = dist.get_world_size()
    table = harness.Table("us", IMPLS, ratios=[("torch_tp", "raw"), ("torch_tp", "functional")],
                          paired=[("torch_tp", "raw"), ("torch_tp", "functional")])
    for nbytes in args.sizes or (NOOP_SIZES if args.noop_group else SIZES):
        unit = 4 * p * (4 if args.dim else 1)
        if nbytes % unit:
            raise ValueError(f"size {nbytes} B must be a multiple of {unit} B (float32 x world size x rows)")
        all_steps, resets, full = {}, {}, {}
        for op in args.ops:
            calls, reset, full[op] = steps(op, nbytes, group, args.dim)
            all_steps.update({f"{op} {impl}": fn for impl, fn in calls.items()})
            resets.update({f"{op} {impl}": reset for impl in calls if reset})
        rotate = harness.rotations(IMPLS)
        order = lambda r: [f"{op} {impl}" for op in args.ops for impl in rotate(r)]  # noqa: E731
        if args.noop_group:  # batches of calls, one world barrier per round (the fake one does not wait)
            samples = harness.time_interleaved(all_steps, max(3, NOOP_CALLS // args.batch), order=order,
                                               calls=args.batch, warmup=2, barrier="round")
        else:  # GC stays on, as when the figures in RESULTS.md were taken
            samples = harness.time_interleaved(all_steps, repeats(nbytes, args), order=order, reset=resets,
                                               warmup=2 if args.quick else 5, gc_off=False)
        for op in args.ops:
            keys = {impl: f"{op} {impl}" for impl in IMPLS}
            bw = {f"busbw {i} GB/s": busbw_GBps(op, full[op], samples.median(keys[i], "s"), p)
                  for i in ("torch_tp", "raw")}
            table.add({"size": fmt_size(nbytes), "op": op}, samples, keys, x=nbytes, panel=op,
                      extra={} if args.noop_group else bw)
        if dist.get_rank() == 0:
            print(f"[bench_collectives] {fmt_size(nbytes)} done", flush=True)
    where = "" if (args.backend, args.dim) == ("gloo", 0) else f", {args.backend} backend, along dim {args.dim}"
    return {
        "tag": "bench_collectives" + (f" {args.backend} dim{args.dim}" if where else ""),
        "stem": "collectives" + (f"_{args.backend}_dim{args.dim}" if where else ""),
        "title": "Collectives: torch_tp vs functional collectives vs raw c10d" + where,
        "about": "CPU float32; size: the per-rank input (all_gather: the input shard). **torch_tp**: "
        "`torch.ops.torch_tp.{all_reduce, all_gather, reduce_scatter}` by group name; **functional**: "
        f"`funcol.all_reduce`, `{FC_ALL_GATHER.__name__}`, `{FC_REDUCE_SCATTER.__name__}` and the wait; "
        f"**raw**: `dist.all_reduce` in place, `{ALL_GATHER.__name__}`, `{REDUCE_SCATTER.__name__}` into "
        "preallocated buffers. The three of every op interleaved in each repeat, rotating; busbw as nccl-tests."
        + (" all_gather and reduce_scatter along dim 1 of a [4, n] input for torch_tp and functional; raw along "
           "dim 0 of the same bytes." if args.dim else ""),
        "tables": [table],
    }


def numel(dtype: torch.dtype, size: int, p: int) -> int:
    n = size // dtype.itemsize
    return n - n % p


def dist_calls(dtype: torch.dtype, size: int, group):
    """``{op: call}``: each op through ``dist`` on preallocated buffers of its own; ``size`` is nccl-tests' S: the
    all_reduce tensor, the all_gather output, the reduce_scatter input. Zeros: in-place sums stay zero."""
    p = group.size()
    full, piece = torch.zeros(numel(dtype, size, p), dtype=dtype), torch.zeros(numel(dtype, size, p) // p, dtype=dtype)
    reduced, gathered, scattered = full.clone(), torch.empty_like(full), torch.empty_like(piece)
    return {"all_reduce": lambda: dist.all_reduce(reduced, group=group),
            "all_gather": lambda: ALL_GATHER(gathered, piece, group=group),
            "reduce_scatter": lambda: REDUCE_SCATTER(scattered, full, group=group)}


def memcpy_GBps() -> float:
    """Single-core memcpy, the physical limit: 16 MiB ``copy_`` on rank 0 while the others wait, bytes
    copied per second, the median of 20 after warm-up."""
    value = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        src = torch.randn(4 * MiB)
        dst = torch.empty_like(src)
        times = [harness.wall_time(lambda: dst.copy_(src), 1)[0] for _ in range(25)]
        value[0] = 16 * MiB / harness.quantile(times[5:], 0.5) / 1e9
    dist.broadcast(value, src=0)
    return value.item()


def against_gloo(args):
    p = dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "torch_tp": dist.new_group(backend="torch_tp")}
    memcpy = memcpy_GBps()
    table = harness.Table("us", BACKENDS, ratios=[("gloo", "torch_tp")])
    for size in args.sizes or (FEW_SIZES if args.quick else SIZES):
        for op in args.ops:
            for dtype_name in DTYPES:
                calls = {name: dist_calls(DTYPES[dtype_name], size, g)[op] for name, g in groups.items()}
                # batches long enough for the clock at small S; a barrier on the group being timed
                samples = harness.time_interleaved(
                    calls, 3 if args.quick else 30 if size <= MiB else 15 if size <= 16 * MiB else 7,
                    calls=20 if size <= 64 * KiB else 5 if size <= MiB else 1, warmup=1,
                    barrier=lambda name: dist.barrier(group=groups[name]))
                bw = {name: busbw_GBps(op, size, samples.median(name, "s"), p) for name in BACKENDS}
                table.add({"op": op, "dtype": dtype_name, "size": fmt_size(size)}, samples,
                          x=size, panel=f"{op} {dtype_name}",
                          extra={"gloo busbw GB/s": bw["gloo"], "torch_tp busbw GB/s": bw["torch_tp"],
                                 "torch_tp busbw / memcpy": bw["torch_tp"] / memcpy})
        if dist.get_rank() == 0:
            print(f"[bench_collectives --vs-gloo] {fmt_size(size)} done", flush=True)
    return {
        "tag": f"bench_backend ws={p}", "stem": f"backend_ws{p}",
        "title": f"The torch_tp backend against gloo, {p} ranks on one machine",
        "about": "Both backends in one job: the default gloo group and `dist.new_group(backend=\"torch_tp\")` "
        f"over the same ranks, alternating within each repeat. `dist.all_reduce` (in place), `{ALL_GATHER.__name__}`, "
        f"`{REDUCE_SCATTER.__name__}`; size S as nccl-tests: the all_reduce tensor, the all_gather output, the "
        "reduce_scatter input; busbw = S/t x 2(p-1)/p (all_reduce) or (p-1)/p. A sample is a batch of 20 calls "
        "up to 64 KiB, 5 up to 1 MiB, else 1.",
        "memcpy_GBps": memcpy, "buffer_bytes_env": os.environ.get("TORCH_TP_SHM_BUFFER_BYTES"),
        "tables": [table],
        "notes": [f"Single-core memcpy bandwidth, same run: **{memcpy:.2f} GB/s** (16 MiB `copy_`, median)."],
    }


def calls_per_sample(size: int) -> int:
    return 100 if size <= 64 * KiB else 10 if size <= MiB else 1


def latency_steps(dtype: torch.dtype, size: int, tp, ds_call, ds_raw):
    """Every implementation of one (dtype, size), each on buffers of its own. ``tp dist``: `dist.*` on the
    torch_tp group; ``tp op``: the functional torch_tp op (a fresh output); ``tp op_``: the in-place one,
    DeepSpeed's raw op's like-for-like."""
    p, name = tp.size(), tp.group_name
    buf = {k: torch.zeros(numel(dtype, size, p), dtype=dtype) for k in ("tp op", "tp op_", "ds", "ds raw")}
    shard, full = torch.zeros(numel(dtype, size, p) // p, dtype=dtype), torch.zeros(numel(dtype, size, p), dtype=dtype)
    tp_dist = dist_calls(dtype, size, tp)
    out = {
        "tp dist": tp_dist["all_reduce"],
        "tp op": lambda: torch.ops.torch_tp.all_reduce(buf["tp op"], "sum", name),
        "tp op_": lambda: torch.ops.torch_tp.all_reduce_(buf["tp op_"], "sum", name),
        "gloo": dist_calls(dtype, size, dist.group.WORLD)["all_reduce"],
        "all_gather tp dist": tp_dist["all_gather"],
        "all_gather tp op": lambda: torch.ops.torch_tp.all_gather(shard, 0, name, None),
        "reduce_scatter tp dist": tp_dist["reduce_scatter"],
        "reduce_scatter tp op": lambda: torch.ops.torch_tp.reduce_scatter(full, 0, "sum", name),
    }
    if ds_call is not None:
        out["ds"] = lambda: ds_call(buf["ds"])
        out["ds raw"] = lambda: ds_raw(buf["ds raw"])
    return out


def breakdown(tp, rounds: int, ds_raw) -> harness.Table:
    """A 4 KiB float32 all-reduce by layer, in the same rounds: c10d's wrapper, dispatcher and Work alone
    (no-op group), a transport step without data (barrier), the call handed to the worker thread (async +
    wait), the inline call, the ops, and what a functional op pays before it communicates (aten.clone)."""
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


def latency(args):
    p = dist.get_world_size()
    load_start = os.getloadavg()
    tp = dist.new_group(backend="torch_tp")
    ds, peer = harness.deepspeed_peer()
    ds_call, ds_raw = (ds.comm.inference_all_reduce, torch.ops.deepspeed.inference_all_reduce_) if ds else (None, None)
    rounds = lambda size: 5 if args.quick else 15 if size <= MiB else 7  # noqa: E731
    tables = [breakdown(tp, rounds(4 * KiB), ds_raw)]
    table = harness.Table("us", LATENCY_IMPLS, ratios=[("ds", "tp dist"), ("ds raw", "tp op"), ("ds raw", "tp op_")],
                          title="us per call")
    for size in args.sizes or FEW_SIZES:
        for dtype_name in DTYPES:
            samples = harness.time_interleaved(latency_steps(DTYPES[dtype_name], size, tp, ds_call, ds_raw),
                                               rounds(size), calls=calls_per_sample(size), warmup=1,
                                               barrier=lambda key: dist.barrier(group=tp))
            table.add({"dtype": dtype_name, "size": fmt_size(size)}, samples, x=size, panel=dtype_name)
            if dist.get_rank() == 0:
                print(f"[bench_collectives --latency] {dtype_name} {fmt_size(size)} done", flush=True)
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
    p = harness.parser(__doc__, quick="smoke run: a tenth of the repeats (--noop-group: none fewer; --vs-gloo: four "
                       "sizes, three repeats; --latency: five rounds per row)", noop_batch=100, backend="gloo")
    p.add_argument("--vs-gloo", action="store_true", help="the torch_tp backend against gloo; writes backend_ws<p>.*")
    p.add_argument("--latency", action="store_true",
                   help="the torch_tp backend against DeepSpeed and gloo; writes backend_latency_ws<p>.*")
    p.add_argument("--sizes", type=sizes, help="comma-separated sizes, e.g. 4K,1M (default: 4 KiB .. 64 MiB, x4 "
                   "steps; --noop-group: 64,4K,64K; --latency and --vs-gloo --quick: 4K,64K,1M,16M)")
    p.add_argument("--ops", type=harness.names(OPS), default=",".join(OPS),
                   help="comma-separated subset of %(default)s (not --latency)")
    p.add_argument("--dim", type=int, default=0, choices=[0, 1],
                   help="1: all_gather and reduce_scatter along dim 1 of a [4, n] input (raw c10d: dim 0)")
    args = p.parse_args()
    if (args.vs_gloo or args.latency) and (args.backend != "gloo" or args.noop_group or args.dim):
        p.error("--vs-gloo and --latency make their own torch_tp group beside the gloo world group")
    measure = against_gloo if args.vs_gloo else latency if args.latency else overhead
    sys.exit(harness.run(args, measure))
