#!/usr/bin/env python3
"""torch_tp's collective ops against torch's functional collectives and raw c10d, on a gloo group (CPU, float32).

With ``--dim 1`` the all-gather and reduce-scatter run along dim 1 of a [4, n] input, as a sequence-parallel
gather of [b, s, h] runs along s; raw c10d, which has no dim, moves the same bytes along dim 0 (the floor).
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import harness
from harness import ALL_GATHER, KiB, MiB, REDUCE_SCATTER

OPS = ["all_reduce", "all_gather", "reduce_scatter"]
IMPLS = ["torch_tp", "functional", "raw"]
SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
NOOP_SIZES = [64, 4 * KiB, 64 * KiB]
# Timed repeats by size: many where a call is short and noisy, few where one takes tens of ms (full run
# about 4 minutes on 2 cores); --quick takes about a tenth.
REPEATS = {4 * KiB: 400, 16 * KiB: 400, 64 * KiB: 300, 256 * KiB: 200, MiB: 120, 4 * MiB: 60, 16 * MiB: 30,
           64 * MiB: 15}
# The functional collectives' new names where they exist, as harness.ALL_GATHER takes c10d's.
FC_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
FC_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def repeats(nbytes: int, args) -> int:
    n = REPEATS[min((s for s in REPEATS if s >= nbytes), default=max(REPEATS))]
    return max(3, n // 10 if args.quick else n)


def steps(op: str, nbytes: int, group: dist.ProcessGroup, dim: int):
    """The three implementations of one op (size: the per-rank input; all_gather: the input shard), the
    untimed reset, and the full tensor's bytes for bus bandwidth. The raw call writes into buffers made
    here, so it is the communication alone; the others allocate their outputs. ``dim``: the all-gather's
    and reduce-scatter's dim of a [4, n] input (0: a flat one) for torch_tp and the functional ones."""
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


def measure(args):
    group = harness.noop_group() if args.noop_group else dist.group.WORLD
    p = dist.get_world_size()
    table = harness.Table("us", IMPLS, ratios=[("torch_tp", "raw"), ("torch_tp", "functional")],
                          paired=[("torch_tp", "raw"), ("torch_tp", "functional")])
    for nbytes in args.sizes:
        unit = 4 * p * (4 if args.dim else 1)
        if nbytes % unit:
            raise ValueError(f"size {nbytes} B must be a multiple of {unit} B (float32 x world size x rows)")
        all_steps, resets, full = {}, {}, {}
        for op in args.ops:
            calls, reset, full[op] = steps(op, nbytes, group, args.dim)
            for impl, fn in calls.items():
                all_steps[f"{op} {impl}"] = fn
                if reset:
                    resets[f"{op} {impl}"] = reset
        rotate = harness.rotations(IMPLS)
        order = lambda r: [f"{op} {impl}" for op in args.ops for impl in rotate(r)]  # noqa: E731
        if args.noop_group:  # batches of calls, one world barrier per round (the fake one does not wait)
            samples = harness.time_interleaved(all_steps, max(3, args.calls // args.batch), order=order,
                                               calls=args.batch, warmup=2, barrier="round")
        else:  # GC stays on, as when the figures in RESULTS.md were taken
            samples = harness.time_interleaved(all_steps, repeats(nbytes, args), order=order, reset=resets,
                                               warmup=2 if args.quick else 5, gc_off=False)
        for op in args.ops:
            keys = {impl: f"{op} {impl}" for impl in IMPLS}
            bw = {f"busbw {i} GB/s": harness.busbw_GBps(op, full[op], samples.median(keys[i], "s"), p)
                  for i in ("torch_tp", "raw")}
            table.add({"size": harness.fmt_size(nbytes), "op": op}, samples, keys, x=nbytes, panel=op,
                      extra={} if args.noop_group else bw)
        if dist.get_rank() == 0:
            print(f"[bench_collectives] {harness.fmt_size(nbytes)} done", flush=True)
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


if __name__ == "__main__":
    p = harness.parser(__doc__, quick="smoke run: a tenth of the repeats (with --noop-group: see --calls)",
                       noop_batch=100, backend="gloo")
    p.add_argument("--sizes", type=harness.sizes, help="comma-separated per-rank sizes, e.g. 4K,1M (default: "
                   "4 KiB .. 64 MiB, x4 steps; with --noop-group: 64,4K,64K)")
    p.add_argument("--ops", type=harness.names(OPS), default=",".join(OPS),
                   help="comma-separated subset of %(default)s")
    p.add_argument("--dim", type=int, default=0, choices=[0, 1],
                   help="1: all_gather and reduce_scatter along dim 1 of a [4, n] input (raw c10d: dim 0)")
    p.add_argument("--calls", type=int, default=5000,
                   help="with --noop-group: timed calls per size, op and implementation (default: %(default)s)")
    args = p.parse_args()
    args.sizes = args.sizes or (NOOP_SIZES if args.noop_group else SIZES)
    sys.exit(harness.run(args, measure))
