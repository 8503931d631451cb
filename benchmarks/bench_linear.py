#!/usr/bin/env python3
r"""Benchmark a tensor-parallel MLP block: torch_tp's linear ops vs DTensor TP vs GEMMs + all-reduces.

Launch with ``torchrun``, one process per rank, on a gloo process group (CPU
tensors, float32, one intra-op thread per rank)::

    torchrun --nproc-per-node 2 benchmarks/bench_linear.py [--out-dir benchmarks] [--quick]

The block is Megatron's MLP on a replicated input ``x [batch, hidden]``::

    y = Linear(4h, h)( gelu( Linear(h, 4h)(x) ) )
        ^ row-parallel      ^ column-parallel

Each timed step is one forward and one backward, ``y.backward(grad_y)`` with
a fixed upstream gradient (the same on every rank), computing the gradients of
x and of all four parameters. Implementations, timed side by side in one run:

* ``torch_tp``: ``torch.ops.torch_tp.column_parallel_linear`` (weight rows and
  bias sharded) -> ``F.gelu`` -> ``torch.ops.torch_tp.row_parallel_linear``
  (weight columns sharded, bias whole), shards from ``torch_tp.ops.shard``;
* ``torch_tp fused``: the same with the column op's fused
  ``activation="gelu_tanh"`` instead of ``F.gelu`` (the tanh approximation,
  so a slightly different function: checked against the unfused ops with
  ``F.gelu(approximate="tanh")``, not against the others);
* ``DTensor``: the same two ``nn.Linear`` layers in an ``nn.Module``,
  ``parallelize_module(model, mesh, {"up": ColwiseParallel(), "down":
  RowwiseParallel()})`` on ``init_device_mesh("cpu", (world,))``, the same
  weights;
* ``floor``: no framework, no autograd: the local GEMMs of the shard sizes
  (``addmm``, ``gelu``, ``mm`` forward; ``gelu_backward`` and four ``mm``
  backward, bias gradients as row sums) plus the one in-place ``dist.all_reduce``
  the forward needs (the row layer's partial output) and the one the backward
  needs (the column layer's partial input gradient), run one after the other.
  It is what the math and the communication cost on their own. torch_tp
  overlaps the backward all-reduce with the weight-gradient GEMM (NOTE
  [backward overlap] in csrc/ops/linear.cpp) and so may come in under it.

NOTE [same computation]: before timing, at every size, every rank runs each
implementation once and checks (``torch.testing.assert_close``, rtol 1e-4)
that torch_tp, DTensor and the floor give the same y and the same gradients
of x and of this rank's parameter shards (DTensor's gradients taken as their
local shards in the parameters' placements), that torch_tp matches the
unsharded block run with plain autograd on one rank (its gradients cut to the
shards), and that the fused op matches the unfused ops with the tanh GELU
(atol 1e-5 scaled by each tensor's largest magnitude). Any mismatch on any
rank stops the run, on every rank.

NOTE [method] (benchmarks/_common.py's, with these choices): every repeat runs one step of each implementation, in an order
that cycles through all 24 permutations from repeat to repeat, so machine
drift hits them equally and no implementation always follows the same one
(whose leftovers, e.g. DTensor's cache footprint, it would pay for); gradients
are reset (set to None) untimed before each step, and each timed step is
preceded by ``dist.barrier()`` so the ranks start together. A step ends when y
and x's gradient exist (DTensor hands back y as an AsyncCollectiveTensor: the
step waits for it). Each rank records its own wall time per step; after the
run the times are all-reduced with MAX, so a repeat's time is that of the
slowest rank. Reported: median (p10/p90 in the json) over repeats; ratios are
ratios of medians; differences are medians of the per-repeat paired
differences. Cyclic GC is off during the timed steps.

A second phase (run first; seconds) takes the communication out, as
bench_collectives.py does (NOTE [no-op process group] there): the same four
implementations on a group created with ``dist.new_group(backend="fake")``
(torch's FakeProcessGroup: collectives complete at once, all_reduce does
nothing), DTensor on ``DeviceMesh.from_group`` of that group, at the small
size. Each round runs one batch of back-to-back steps per implementation in a
permuted order (as above) after a gloo barrier; per-step time = batch time / batch
length, max over ranks, median over batches. Values are meaningless there
(only shapes are checked); what remains is each framework's own per-step cost.
``--no-overhead`` skips it.

Targets, printed PASS/MISS:

* small size: torch_tp's time per layer (step / 2 layers) at most one fifth
  of DTensor's, DTensor / torch_tp >= 5. There the GEMMs take microseconds
  and a step is framework cost plus communication latency; a C++ op that
  skips DTensor's dispatch, sharding propagation and wrapping should cost a
  small fraction of it.
* large sizes: torch_tp within 5 % of the floor, torch_tp / floor <= 1.05.
  There the GEMMs and the two all-reduces are the step; a framework should
  add nothing to them but its bookkeeping, which 5 % bounds.

Rank 0 writes ``linear.json`` (all figures, per-repeat times, machine),
``linear.png`` and the ``bench_linear`` section of ``RESULTS.md`` (text
outside its markers is kept) into ``--out-dir``, and prints the tables.
"""
import argparse
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import torch_tp  # noqa: F401  (registers torch.ops.torch_tp.*)
from _common import (
    Output,
    add_no_overhead_arg,
    add_output_args,
    add_repeat_scale_arg,
    bar_panel,
    check_everywhere,
    close,
    figure,
    json_link,
    materialize,
    method_notes,
    noop_phase,
    noop_section,
    permutations,
    plot_title,
    run,
    save_figure,
    scaled_repeats,
    section_head,
    target_lines,
    time_interleaved,
)

Size = Tuple[int, int]  # (batch, hidden)

# (batch, hidden); the MLP is hidden -> 4 * hidden -> hidden. The first is the
# per-call-overhead size (GEMMs of microseconds, the step is framework +
# communication latency); the last two are GEMM-bound; the one between shows
# the crossover.
DEFAULT_SIZES: List[Size] = [(8, 256), (128, 512), (512, 1024), (1024, 2048)]
# --quick leaves out the largest (its GEMMs alone would take most of a smoke run).
QUICK_SIZES: List[Size] = [(8, 256), (128, 512), (512, 1024)]
SMALL_SIZES = {(8, 256)}  # judged by the per-layer target
LARGE_SIZES = {(512, 1024), (1024, 2048)}  # judged by the within-5%-of-floor target

# Timed repeats (one step of each implementation per repeat): fewer where a step
# is longer, so the full run takes minutes on 2 cores with 2 ranks; --quick is
# a smoke run.
FULL_REPEATS = {(8, 256): 400, (128, 512): 120, (512, 1024): 30, (1024, 2048): 12}
QUICK_REPEATS = {(8, 256): 40, (128, 512): 10, (512, 1024): 4, (1024, 2048): 3}
# Untimed steps per implementation after the check (which is one more).
FULL_WARMUP = {(8, 256): 10, (128, 512): 5, (512, 1024): 2, (1024, 2048): 1}
QUICK_WARMUP = {(8, 256): 3, (128, 512): 1, (512, 1024): 0, (1024, 2048): 0}

IMPLS = ["torch_tp", "torch_tp_fused", "dtensor", "floor"]
IMPL_LABELS = {
    "torch_tp": "torch_tp",
    "torch_tp_fused": "torch_tp fused gelu_tanh",
    "dtensor": "DTensor TP",
    "floor": "floor (GEMMs + 2 all-reduces)",
}

# The no-op-group phase: the small size, steps timed in batches.
OVERHEAD_SIZES: List[Size] = [(8, 256)]
OVERHEAD_STEPS = 2000  # timed steps per implementation; --quick: OVERHEAD_STEPS_QUICK
OVERHEAD_STEPS_QUICK = 300
OVERHEAD_BATCH = 50  # steps per timed batch; --quick: OVERHEAD_BATCH_QUICK
OVERHEAD_BATCH_QUICK = 25
OVERHEAD_WARMUP_BATCHES = 2

RTOL = 1e-4  # fp32; the implementations run the same GEMMs on the same shards
SMALL_TARGET = 5.0  # DTensor / torch_tp per layer >= this
LARGE_TARGET = 1.05  # torch_tp / floor <= this

# ---------------------------------------------------------------------------
# arguments


def parse_sizes(text: str) -> List[Size]:
    """``'8x256,512x1024'`` -> ``[(8, 256), (512, 1024)]`` (batch x hidden)."""
    sizes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        b, _, h = item.partition("x")
        sizes.append((int(b), int(h)))
    return sizes


def fmt_size(size: Size) -> str:
    return f"{size[0]}x{size[1]}"


def nearest(table: Dict[Size, int], size: Size) -> int:
    """The table's value for size, or for the listed size with the nearest step FLOPs."""
    if size in table:
        return table[size]
    flops = lambda s: s[0] * s[1] * s[1]  # noqa: E731
    return table[min(table, key=lambda s: abs(flops(s) - flops(size)))]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_linear.py",
        description=(
            "Time forward+backward of a column->GELU->row tensor-parallel MLP block with torch_tp's "
            "linear ops, with DTensor tensor parallelism (parallelize_module, ColwiseParallel/"
            "RowwiseParallel) and with plain GEMMs + the two all-reduces (the floor), side by side in "
            "one run on a gloo group (CPU, float32, 1 thread per rank). "
            "Launch with: torchrun --nproc-per-node 2 benchmarks/bench_linear.py"
        ),
        epilog=(
            "Method: outputs and gradients checked equal first; implementations interleaved per "
            "repeat (order cycling through all permutations), dist.barrier() before each timed step, per-step times "
            "max-reduced over ranks, medians over repeats. First (unless --no-overhead), the same "
            "steps on a no-op process group (dist.new_group(backend='fake')) at the small size: "
            "each framework's per-step cost without communication. Rank 0 writes linear.json, "
            "linear.png and the bench_linear section of RESULTS.md into --out-dir."
        ),
    )
    add_output_args(p, "linear.json, linear.png",
                    quick="smoke run: the sizes but the largest, a few repeats each, a short no-op-group phase")
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated batch x hidden sizes, e.g. '8x256,512x1024' (default: "
        + ",".join(fmt_size(s) for s in DEFAULT_SIZES)
        + "; with --quick: "
        + ",".join(fmt_size(s) for s in QUICK_SIZES)
        + ")",
    )
    add_repeat_scale_arg(p, "size")
    add_no_overhead_arg(p, "per-step")
    args = p.parse_args(argv)
    args.sizes = parse_sizes(args.sizes) if args.sizes else list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if not args.sizes:
        p.error("--sizes: no sizes given")
    args.overhead_steps = OVERHEAD_STEPS_QUICK if args.quick else OVERHEAD_STEPS
    args.overhead_batch = OVERHEAD_BATCH_QUICK if args.quick else OVERHEAD_BATCH
    return args


# ---------------------------------------------------------------------------
# the four implementations of one step


class MLP(nn.Module):
    """The unsharded block DTensor parallelizes: up (h -> 4h), GELU, down (4h -> h)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Case:
    """One size on one group: the weights, the inputs and each implementation's step.

    ``steps[impl]()`` runs one forward+backward and returns ``(y, grads)``, grads
    being this rank's ``{"x", "w1", "b1", "w2", "b2"}`` (shards for the sharded
    parameters); ``resets[impl]()`` clears the gradients, untimed.
    """

    def __init__(self, size: Size, group: dist.ProcessGroup, mesh: DeviceMesh) -> None:
        batch, hidden = size
        world = group.size()
        ffn = 4 * hidden
        if ffn % world:
            raise ValueError(f"4 * hidden = {ffn} must be a multiple of the world size {world}")
        self.size = size
        # The same full weights and inputs on every rank (same seed).
        gen = torch.Generator().manual_seed(1234 + batch * 7 + hidden)
        w1 = torch.randn(ffn, hidden, generator=gen) / hidden**0.5
        b1 = torch.randn(ffn, generator=gen) * 0.1
        w2 = torch.randn(hidden, ffn, generator=gen) / ffn**0.5
        b2 = torch.randn(hidden, generator=gen) * 0.1
        x = torch.randn(batch, hidden, generator=gen)
        self.grad_y = torch.randn(batch, hidden, generator=gen)

        gname = group.group_name
        shards = {
            "w1": torch_tp.ops.shard(w1, 0, group),
            "b1": torch_tp.ops.shard(b1, 0, group),
            "w2": torch_tp.ops.shard(w2, 1, group),
            "b2": b2.clone(),
        }
        self.shard_shapes = {k: list(v.shape) for k, v in shards.items()}
        # For the check only: the unsharded block, plain autograd, on this rank alone.
        self._full = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "x": x}
        self._group = group

        # torch_tp (both variants share the parameters; each step starts from no grads).
        tp = {k: v.clone().requires_grad_() for k, v in shards.items()}
        x_tp = x.clone().requires_grad_()
        grad_y = self.grad_y
        col = torch.ops.torch_tp.column_parallel_linear
        row = torch.ops.torch_tp.row_parallel_linear

        def tp_grads() -> Dict[str, torch.Tensor]:
            return {"x": x_tp.grad, **{k: v.grad for k, v in tp.items()}}

        def step_tp(approximate: str = "none") -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
            h = F.gelu(col(x_tp, tp["w1"], tp["b1"], gname), approximate=approximate)
            y = row(h, tp["w2"], tp["b2"], gname)
            y.backward(grad_y)
            return y, tp_grads()

        def step_tp_fused() -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
            h = col(x_tp, tp["w1"], tp["b1"], gname, None, None, "gelu_tanh")
            y = row(h, tp["w2"], tp["b2"], gname)
            y.backward(grad_y)
            return y, tp_grads()

        def reset_tp() -> None:
            x_tp.grad = None
            for v in tp.values():
                v.grad = None

        # DTensor: the same weights, loaded before parallelizing. src_data_rank=None:
        # every rank takes its own chunk of the (identical) full weights, no scatter.
        model = MLP(hidden)
        with torch.no_grad():
            model.up.weight.copy_(w1)
            model.up.bias.copy_(b1)
            model.down.weight.copy_(w2)
            model.down.bias.copy_(b2)
        parallelize_module(
            model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}, src_data_rank=None
        )
        self.model = model
        x_dt = x.clone().requires_grad_()
        dt_params = {"w1": model.up.weight, "b1": model.up.bias, "w2": model.down.weight, "b2": model.down.bias}

        def dt_local_grad(p: torch.Tensor) -> torch.Tensor:
            g = p.grad
            if isinstance(g, DTensor):
                if tuple(g.placements) != tuple(p.placements):
                    g = g.redistribute(p.device_mesh, p.placements)
                g = g.to_local()
            return materialize(g)

        def step_dt() -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
            y = model(x_dt)
            y.backward(grad_y)
            # The step is done when y exists (its forward all-reduce has completed).
            return materialize(y), {"x": materialize(x_dt.grad)}

        def dt_grads() -> Dict[str, torch.Tensor]:
            return {k: dt_local_grad(p) for k, p in dt_params.items()}

        def reset_dt() -> None:
            x_dt.grad = None
            model.zero_grad(set_to_none=True)

        # The floor: the same math by hand, the two all-reduces in place, one after the other.
        fw1, fb1, fw2, fb2 = (shards[k] for k in ("w1", "b1", "w2", "b2"))
        x_fl = x.clone()
        gelu_backward = torch.ops.aten.gelu_backward

        def step_floor() -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
            pre = torch.addmm(fb1, x_fl, fw1.t())  # [B, 4h/p]
            h = F.gelu(pre)
            y = torch.mm(h, fw2.t())  # [B, h], partial sum
            dist.all_reduce(y, group=group)  # forward all-reduce
            y += fb2
            g = grad_y
            g_b2 = g.sum(0)
            g_w2 = torch.mm(g.t(), h)  # [h, 4h/p]
            g_h = torch.mm(g, fw2)  # [B, 4h/p]
            g_pre = gelu_backward(g_h, pre)
            g_w1 = torch.mm(g_pre.t(), x_fl)  # [4h/p, h]
            g_b1 = g_pre.sum(0)
            g_x = torch.mm(g_pre, fw1)  # [B, h], partial sum
            dist.all_reduce(g_x, group=group)  # backward all-reduce
            return y, {"x": g_x, "w1": g_w1, "b1": g_b1, "w2": g_w2, "b2": g_b2}

        self.steps: Dict[str, Callable[[], Tuple[torch.Tensor, Dict[str, torch.Tensor]]]] = {
            "torch_tp": step_tp,
            "torch_tp_fused": step_tp_fused,
            "dtensor": step_dt,
            "floor": step_floor,
        }
        self.resets: Dict[str, Callable[[], None]] = {
            "torch_tp": reset_tp,
            "torch_tp_fused": reset_tp,
            "dtensor": reset_dt,
            "floor": lambda: None,
        }
        self._step_tp = step_tp
        self._dt_grads = dt_grads

    def run(self, impl: str) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """One untimed step with full results (DTensor's parameter gradients as local shards)."""
        self.resets[impl]()
        y, grads = self.steps[impl]()
        if impl == "dtensor":
            grads = {**grads, **self._dt_grads()}
        return y.detach().clone(), {k: materialize(v).detach().clone() for k, v in grads.items()}

    def reference(self) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The unsharded block with plain autograd on this rank; gradients cut to this rank's shards."""
        full = {k: v.clone().requires_grad_() for k, v in self._full.items()}
        y = F.linear(F.gelu(F.linear(full["x"], full["w1"], full["b1"])), full["w2"], full["b2"])
        y.backward(self.grad_y)
        g = {k: v.grad for k, v in full.items()}
        cut = {"w1": (g["w1"], 0), "b1": (g["b1"], 0), "w2": (g["w2"], 1)}
        grads = {k: torch_tp.ops.shard(t, d, self._group) for k, (t, d) in cut.items()}
        return y.detach(), {"x": g["x"], "b2": g["b2"], **grads}

    def check(self) -> Dict[str, float]:
        """NOTE [same computation]: assert torch_tp == DTensor == floor == the unsharded block, and fused ==
        unfused with the tanh GELU.

        Returns the largest relative difference seen per pair (for the json).
        """
        results = {impl: self.run(impl) for impl in IMPLS}
        self.resets["torch_tp"]()
        y_t, g_t = self._step_tp("tanh")
        tanh_ref = (y_t.detach().clone(), {k: v.detach().clone() for k, v in g_t.items()})
        self.resets["torch_tp"]()
        pairs = [
            ("dtensor vs torch_tp", results["dtensor"], results["torch_tp"]),
            ("floor vs torch_tp", results["floor"], results["torch_tp"]),
            ("torch_tp vs unsharded nn reference", results["torch_tp"], self.reference()),
            ("torch_tp_fused vs torch_tp with F.gelu(approximate='tanh')", results["torch_tp_fused"], tanh_ref),
        ]
        worst = {}
        for name, (y, g), (y_ref, g_ref) in pairs:
            got = {"y": y, **g}
            ref = {"y": y_ref, **g_ref}
            if set(got) != set(ref):
                raise AssertionError(
                    f"{fmt_size(self.size)} {name}: result names differ: {sorted(got)} vs {sorted(ref)}"
                )
            # atol: fp32's default 1e-5, scaled with the tensor's magnitude where that is above 1.
            worst[name] = max(close(got[k], ref[k], f"{fmt_size(self.size)}: {name}: {k}", RTOL, 1e-5, min_scale=1.0)
                              for k in ref)
        return worst


# ---------------------------------------------------------------------------
# measurement


def bench(args: argparse.Namespace, group: dist.ProcessGroup, mesh: DeviceMesh, rank: int, world: int) -> List[Dict]:
    records = []
    for size in args.sizes:
        t_size = time.perf_counter()
        case = Case(size, group, mesh)
        # also the first (untimed) step of each
        agreement = check_everywhere(
            case.check, f"bench_linear: the implementations disagree at {fmt_size(case.size)}", group)
        repeats = scaled_repeats(nearest(QUICK_REPEATS if args.quick else FULL_REPEATS, size), args.repeat_scale)
        warmup = nearest(QUICK_WARMUP if args.quick else FULL_WARMUP, size)
        # Every order of the implementations, cycled through repeat by repeat.
        samples = time_interleaved(case.steps, repeats, group, order=permutations(IMPLS), reset=case.resets,
                                   warmup=warmup)
        elapsed = time.perf_counter() - t_size

        rec: Dict = {
            "batch": size[0],
            "hidden": size[1],
            "size": fmt_size(size),
            "kind": "small" if size in SMALL_SIZES else "large" if size in LARGE_SIZES else "mid",
            "shard_shapes": case.shard_shapes,
            "gemm_flops_per_rank_per_step": 6 * 2 * size[0] * size[1] * (4 * size[1] // world),
            "allreduce_bytes": size[0] * size[1] * 4,
            "repeats": repeats,
            "warmup": warmup,
            "check_max_rel_diff": agreement,
            "elapsed_s": elapsed,
            "impls": {},
        }
        for impl in IMPLS:
            st = samples.stats(impl, "ms")
            st["per_layer_ms"] = st["median_ms"] / 2
            rec["impls"][impl] = st
        med = {k: rec["impls"][k]["median_ms"] for k in IMPLS}
        rec["dtensor_over_torch_tp"] = med["dtensor"] / med["torch_tp"]
        rec["torch_tp_over_floor"] = med["torch_tp"] / med["floor"]
        rec["torch_tp_fused_over_floor"] = med["torch_tp_fused"] / med["floor"]
        rec["dtensor_over_floor"] = med["dtensor"] / med["floor"]
        rec["torch_tp_minus_floor_ms"] = samples.paired("torch_tp", "floor", "ms")
        rec["dtensor_minus_torch_tp_ms"] = samples.paired("dtensor", "torch_tp", "ms")
        records.append(rec)
        if rank == 0:
            print(
                f"[bench_linear] {fmt_size(size):>9}: checked (max rel. diff "
                f"{max(agreement.values()):.1e}), {repeats} repeats x {len(IMPLS)} impls in {elapsed:.1f} s; "
                + ", ".join(f"{k} {med[k]:.3f} ms" for k in IMPLS),
                flush=True,
            )
        del case
    return records


def bench_overhead(args: argparse.Namespace, fake_group: dist.ProcessGroup, world_group: dist.ProcessGroup,
                   rank: int) -> Dict:
    """Per-step time of each implementation on the no-op group (no communication); us per step."""
    batch = args.overhead_batch
    n_batches = max(3, -(-args.overhead_steps // batch))
    # NOTE [distinct mesh names]: DeviceMesh equality and hash ignore the process
    # group (ranks, layout, device type and dim names only), so a mesh over the
    # fake group with the gloo mesh's ranks and names would be "equal" to it, and
    # DTensor's sharding-propagation cache would hand the gloo phase output specs
    # that point at the fake mesh: its collectives would silently not communicate
    # (the check catches this). Different dim names keep the two meshes apart.
    fake_mesh = DeviceMesh.from_group(fake_group, "cpu", mesh_dim_names=("noop_tp",))
    records = []
    for size in OVERHEAD_SIZES:
        t_size = time.perf_counter()
        case = Case(size, fake_group, fake_mesh)
        # Values are not the collective's result on the fake group: check shapes only.
        shapes = {}
        for impl in IMPLS:
            y, grads = case.run(impl)
            shapes[impl] = (tuple(y.shape), tuple((k, tuple(v.shape)) for k, v in sorted(grads.items())))
        if len(set(shapes.values())) != 1:
            raise RuntimeError(f"{fmt_size(size)} on the fake group: result shapes differ: {shapes}")
        # The reset (setting grads to None) is in the batch here; it is a few
        # attribute stores, the same kind of cost for every implementation.
        steps = {impl: lambda reset=case.resets[impl], step=case.steps[impl]: (reset(), step()) for impl in IMPLS}
        samples = time_interleaved(steps, n_batches, world_group, order=permutations(IMPLS), calls=batch,
                                   warmup=OVERHEAD_WARMUP_BATCHES, barrier="round")
        rec: Dict = {"batch": size[0], "hidden": size[1], "size": fmt_size(size), "impls": {}}
        for impl in IMPLS:
            st = samples.stats(impl, "us")
            st["per_layer_us"] = st["median_us"] / 2
            rec["impls"][impl] = st
        med = {k: rec["impls"][k]["median_us"] for k in IMPLS}
        rec["dtensor_over_torch_tp"] = med["dtensor"] / med["torch_tp"]
        rec["torch_tp_minus_floor_us"] = samples.paired("torch_tp", "floor", "us")
        rec["dtensor_minus_torch_tp_us"] = samples.paired("dtensor", "torch_tp", "us")
        records.append(rec)
        if rank == 0:
            print(
                f"[bench_linear] no-op group {fmt_size(size):>9}: {n_batches} x {batch} steps x "
                f"{len(IMPLS)} impls in {time.perf_counter() - t_size:.1f} s",
                flush=True,
            )
        del case
    return {
        "group": "dist.new_group(backend='fake') beside the gloo world group (torch's FakeProcessGroup); "
        "DTensor on DeviceMesh.from_group(fake_group, 'cpu')",
        "steps_per_impl": n_batches * batch,
        "batch": batch,
        "batches": n_batches,
        "warmup_batches": OVERHEAD_WARMUP_BATCHES,
        "method": {
            "timing": "perf_counter around a batch of back-to-back steps (grad reset + forward + backward); "
            "per-step = batch time / batch",
            "interleaved": "each round: one batch of each implementation, order cycling through all permutations; "
            "gloo barrier (untimed) before each round",
            "per_batch_time": "max over ranks",
            "stat": "median over batches",
            "values": "meaningless (collectives do not communicate); shapes checked",
        },
        "results": records,
    }


# ---------------------------------------------------------------------------
# reporting


def fmt_ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def markdown_table(records: List[Dict]) -> str:
    lines = [
        "| batch x hidden | torch_tp ms | torch_tp fused ms | DTensor ms | floor ms | DTensor / torch_tp "
        "| torch_tp / floor | torch_tp - floor ms | fused / floor |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        im = rec["impls"]
        lines.append(
            f"| {rec['size']} | {fmt_ms(im['torch_tp']['median_ms'])} | {fmt_ms(im['torch_tp_fused']['median_ms'])} | "
            f"{fmt_ms(im['dtensor']['median_ms'])} | {fmt_ms(im['floor']['median_ms'])} | "
            f"{rec['dtensor_over_torch_tp']:.2f} | {rec['torch_tp_over_floor']:.3f} | "
            f"{rec['torch_tp_minus_floor_ms']:+.3f} | {rec['torch_tp_fused_over_floor']:.3f} |"
        )
    return "\n".join(lines)


def per_layer_lines(records: List[Dict]) -> List[str]:
    out = []
    for rec in records:
        if rec["kind"] != "small":
            continue
        im = rec["impls"]
        out.append(
            f"Time per layer at {rec['size']} (step / 2 layers): "
            f"torch_tp {im['torch_tp']['per_layer_ms'] * 1e3:.0f} us, "
            f"torch_tp fused {im['torch_tp_fused']['per_layer_ms'] * 1e3:.0f} us, "
            f"DTensor {im['dtensor']['per_layer_ms'] * 1e3:.0f} us, floor {im['floor']['per_layer_ms'] * 1e3:.0f} us."
        )
    return out


def overhead_table(records: List[Dict]) -> str:
    lines = [
        "| batch x hidden | torch_tp us/step | torch_tp fused us/step | DTensor us/step | floor us/step "
        "| torch_tp us/layer | DTensor us/layer | DTensor / torch_tp | torch_tp - floor us |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        im = rec["impls"]
        lines.append(
            f"| {rec['size']} | {im['torch_tp']['median_us']:.1f} | {im['torch_tp_fused']['median_us']:.1f} | "
            f"{im['dtensor']['median_us']:.1f} | {im['floor']['median_us']:.1f} | "
            f"{im['torch_tp']['per_layer_us']:.1f} | {im['dtensor']['per_layer_us']:.1f} | "
            f"{rec['dtensor_over_torch_tp']:.2f} | {rec['torch_tp_minus_floor_us']:+.1f} |"
        )
    return "\n".join(lines)


def evaluate_targets(records: List[Dict], overhead: Optional[Dict]) -> List[Dict]:
    targets = []
    for rec in records:
        if rec["kind"] == "small":
            ratio = rec["dtensor_over_torch_tp"]
            targets.append(
                {
                    "target": f"{rec['size']}: torch_tp time per layer <= 1/{SMALL_TARGET:g} of DTensor's "
                    f"(gloo, end to end)",
                    "value": f"torch_tp {rec['impls']['torch_tp']['per_layer_ms'] * 1e3:.0f} us vs DTensor "
                    f"{rec['impls']['dtensor']['per_layer_ms'] * 1e3:.0f} us per layer: "
                    f"DTensor / torch_tp = {ratio:.2f}",
                    "pass": ratio >= SMALL_TARGET,
                }
            )
        elif rec["kind"] == "large":
            ratio = rec["torch_tp_over_floor"]
            targets.append(
                {
                    "target": f"{rec['size']}: torch_tp within {100 * (LARGE_TARGET - 1):.0f}% of GEMMs + all-reduces",
                    "value": f"torch_tp / floor = {ratio:.3f}",
                    "pass": ratio <= LARGE_TARGET,
                }
            )
    if overhead and "skipped" not in overhead:
        for rec in overhead["results"]:
            ratio = rec["dtensor_over_torch_tp"]
            targets.append(
                {
                    "target": f"{rec['size']}, no-op group (no communication; framework cost only): torch_tp time "
                    f"per layer <= 1/{SMALL_TARGET:g} of DTensor's",
                    "value": f"torch_tp {rec['impls']['torch_tp']['per_layer_us']:.0f} us vs DTensor "
                    f"{rec['impls']['dtensor']['per_layer_us']:.0f} us per layer: DTensor / torch_tp = {ratio:.2f}",
                    "pass": ratio >= SMALL_TARGET,
                }
            )
    return targets


def plot(path: str, report: Dict) -> None:
    records, overhead = report["results"], report.get("overhead_noop_pg")
    panels = [(rec["size"] + " (gloo)", rec["impls"], "ms") for rec in records]
    if overhead and "skipped" not in overhead:
        panels += [(rec["size"] + " (no-op group)", rec["impls"], "us") for rec in overhead["results"]]
    ncol = min(len(panels), 3)
    nrow = -(-len(panels) // ncol)
    fig, axes = figure(nrow, ncol, (4.4, 3.8))
    colors = {"torch_tp": "C0", "torch_tp_fused": "C9", "dtensor": "C1", "floor": "C2"}
    short = {"torch_tp": "torch_tp", "torch_tp_fused": "tp fused", "dtensor": "DTensor", "floor": "floor"}
    for ax, (name, im, unit) in zip(axes.flat, panels):
        bar_panel(ax, [short[k] for k in IMPLS], [colors[k] for k in IMPLS], [im[k] for k in IMPLS], unit, name,
                  f"fwd+bwd step, {unit} (median; p10-p90)")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    save_figure(fig, path, "MLP block fwd+bwd, " + plot_title(report))


def overhead_lines(overhead: Optional[Dict]) -> List[str]:
    return noop_section(overhead, "Per-step cost without communication (no-op process group", lambda o: [
        "The same four steps on `dist.new_group(backend=\"fake\")` (torch's FakeProcessGroup: collectives "
        "complete at once without communicating), DTensor on `DeviceMesh.from_group` of it: what remains "
        "is each framework's own cost (dispatch, autograd, DTensor sharding propagation and wrapping, "
        "allocation) plus the small GEMMs. Each rank times batches of "
        f"{o['batch']} back-to-back steps ({o['steps_per_impl']} per implementation), one batch "
        "per implementation per round, the order cycling through all permutations, after a gloo barrier; "
        "a batch's per-step time is the max over ranks; medians over batches.",
        "",
        overhead_table(o["results"]),
        "",
    ])


def results_section(report: Dict) -> List[str]:
    m, records, overhead = report["machine"], report["results"], report.get("overhead_noop_pg")
    return [
        *section_head(report, "## Linear layers: a column -> GELU -> row MLP block, torch_tp vs DTensor TP vs "
                      "GEMMs + all-reduces", " (`torch.set_num_threads(1)`)"),
        "Method: CPU float32. The block is x [batch, hidden] -> Linear(hidden, 4 hidden) column-parallel -> "
        "GELU -> Linear(4 hidden, hidden) row-parallel (Megatron's MLP); a step is forward + "
        "`y.backward(grad_y)` (fixed upstream gradient), gradients of x and of all parameters. "
        "**torch_tp**: `torch.ops.torch_tp.column_parallel_linear` -> `F.gelu` -> "
        "`torch.ops.torch_tp.row_parallel_linear`; **torch_tp fused**: the column op's "
        "`activation=\"gelu_tanh\"` instead of `F.gelu` (tanh GELU); **DTensor**: the same `nn.Linear` pair under "
        "`parallelize_module(model, mesh, {\"up\": ColwiseParallel(), \"down\": RowwiseParallel()})` on "
        f"`init_device_mesh(\"cpu\", ({m['world_size']},), mesh_dim_names=(\"tp\",))`; "
        "**floor**: the same math by hand without autograd (addmm, gelu, mm; "
        "gelu_backward, 4 mm, bias row sums) plus the forward's and the backward's in-place `dist.all_reduce`, "
        "one after the other (torch_tp overlaps the backward all-reduce with the weight-gradient GEMM, so it "
        "can come in under it). Before timing, at every size, outputs and gradients are checked equal "
        f"(`assert_close`, rtol {RTOL:.0e}) between torch_tp, DTensor, the floor and the unsharded block with "
        "plain autograd (and fused vs unfused with the tanh GELU). Per repeat, one step of each implementation, "
        "the order cycling through all permutations; gradients reset untimed; "
        "`dist.barrier()` before each timed step; a step ends when y and x's gradient exist; the per-repeat "
        "time is the max over ranks; figures are medians over repeats (p10/p90 in the json), ratios are ratios "
        "of medians, `torch_tp - floor` the median of the paired per-repeat differences. GC off while timing.",
        "",
        markdown_table(records),
        "",
        *[line + "\n" for line in per_layer_lines(records)],
        "Targets:",
        "",
        *target_lines(report["targets"]),
        "",
        "![step time per size](linear.png)",
        "",
        *overhead_lines(overhead),
        json_link("linear", overhead),
    ]


# ---------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> Output:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))  # NOTE [distinct mesh names]
    data: Dict = {
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "dtype": "float32",
        "device": "cpu",
        "block": "x [batch, hidden] -> column_parallel Linear(hidden, 4*hidden) -> GELU -> "
        "row_parallel Linear(4*hidden, hidden); y.backward(grad_y)",
        "impls": IMPL_LABELS,
        "targets_rule": {
            "small": f"DTensor / torch_tp (per layer) >= {SMALL_TARGET:g}",
            "large": f"torch_tp / floor <= {LARGE_TARGET:g}",
        },
        "method": {
            "check": f"torch.testing.assert_close rtol {RTOL:g}, atol 1e-5 * max|ref|: y, grad x, grad of "
            "this rank's parameter shards; torch_tp vs DTensor, floor and the unsharded block (plain autograd); "
            "fused vs unfused with tanh GELU",
            "interleaved": "one step of each impl per repeat, order cycling through all permutations of the impls",
            **method_notes("step"),
            "grad_reset": "grads set to None before each step, untimed",
            "step_end": "y and x.grad materialised (DTensor's AsyncCollectiveTensor waited)",
            "ratios": "ratio of medians",
            "differences": "median over repeats of the paired per-repeat difference",
            "gc": "cyclic GC disabled during the timed steps",
            "floor": "addmm+gelu+mm, in-place dist.all_reduce, +bias; gelu_backward + 4 mm + 2 row sums, "
            "in-place dist.all_reduce of grad x; sequential, no autograd",
        },
    }
    overhead: Optional[Dict] = None
    if not args.no_overhead:
        overhead = noop_phase("bench_linear", group, lambda fake: bench_overhead(args, fake, group, rank))
    records = bench(args, group, mesh, rank, world)
    targets = evaluate_targets(records, overhead)
    data.update(results=records, targets=targets)
    if overhead is not None:
        data["overhead_noop_pg"] = overhead
    console = [markdown_table(records), "", *per_layer_lines(records)]
    if overhead is not None and "skipped" not in overhead:
        console += ["", "No-op process group (no communication):", overhead_table(overhead["results"])]
    console += ["", "Targets:", *target_lines(targets)]
    return Output(tag="bench_linear", stem="linear", data=data, section=results_section, plot=plot,
                  console=console)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    return run("bench_linear", args, lambda: measure(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
