#!/usr/bin/env python3
r"""Benchmark tensor-parallel training steps of the example Llama: torch_tp vs DTensor TP, same plan.

Launch with ``torchrun``, one process per rank, on a gloo process group (CPU
tensors, float32, one intra-op thread per rank)::

    torchrun --nproc-per-node 2 benchmarks/bench_tp_block.py [--quick] [--out-dir DIR]

``--backend torch_tp`` runs both implementations on torch_tp's shared-memory
backend instead; its figures go to ``tp_block_torch_tp.{json,png}`` and a
RESULTS.md section of their own. ``--compile`` adds a third implementation,
torch_tp with every transformer block compiled (``block.compile(fullgraph=True)``,
torchtitan's recipe), timed beside eager torch_tp and DTensor; its figures go to
``tp_block_compile.{json,png}`` and their own RESULTS.md section.

The model and the plan are examples/llama_model.py's: torchtitan's Llama module
tree and its tensor-parallel plan with sequence parallelism
(``tp_plan(api)``; vocab-parallel embedding, SequenceParallel norms,
PrepareModuleInput all-gathers, column-parallel wq/wk/wv/w1/w3, row-parallel
wo/w2 with a reduce-scatter back to sequence shards, column-parallel output
with vocab-sharded logits for ``loss_parallel``). Two implementations apply the
same plan to deep copies of one unsharded model (same weights):

* ``torch_tp``: ``torch_tp.parallelize_module`` with ``tp_plan("torch_tp")``
  (torch_tp's styles) and ``torch_tp.loss_parallel``;
* ``DTensor``: ``torch.distributed.tensor.parallel.parallelize_module`` with
  ``tp_plan("torch")`` and torch's ``loss_parallel``.

Configurations (each a fixed batch, timed forward + backward):

* ``block``: one ``TransformerBlock`` of the example model at its default size,
  parallelized with the plan's per-layer entries (the ``layers.*.`` keys, prefix
  cut, as torchtitan parallelizes each block). Its input is this rank's
  sequence shard ``x [b, s/p, d]`` (what the vocab-parallel embedding hands the
  first block), requiring grad; the loss is this rank's part of
  ``sum(out**2) / out.numel()`` over the full output, so the ranks' losses add
  up to the global one and each rank's ``loss.backward()`` gives exactly its
  gradients.
* ``model``: the whole example model at its default config (``LlamaConfig()``:
  vocab 256, dim 128, 4 layers, 4 heads; batch 8, sequence 128: the defaults of
  examples/train_llama.py): ``loss = cross_entropy(model(inputs), targets)``
  and ``loss.backward()`` inside the implementation's ``loss_parallel()``, as
  the example does.
* ``block-large`` and ``model-large``: the same at dim 512, 8 heads, sequence
  256 (batch 8 for the block; batch 2 for the 4-layer model, to keep the run
  short): GEMM-bound steps, to check that torch_tp is no slower where the math
  dominates.

NOTE [same computation]: before timing, every configuration runs one step of
each implementation and of the unsharded model (plain autograd, on each rank
alone) and checks (``torch.testing.assert_close``, rtol 1e-4, atol 1e-5 times
each reference tensor's largest magnitude) that the losses agree and that every
parameter's full gradient agrees (``grad.full_tensor()`` for both; torch_tp's
gradients must also already have their parameters' placements, with no
``Partial`` left after backward); for the block also the gathered output and
input gradient. Any mismatch on any rank
stops the run on every rank.

NOTE [method]: benchmarks/_common.py's, as in bench_linear.py. Every repeat runs one step of each
implementation, the order alternating from repeat to repeat; gradients are set
to None untimed before each step, and each timed step is preceded by
``dist.barrier()``. A step is forward, loss and ``loss.backward()``, and ends
when every parameter holds its complete gradient (NOTE [complete gradients]:
DTensor leaves the SequenceParallel norm weights' gradients as ``Partial(sum)``
pending reductions, which the step reduces with ``redistribute`` to the
parameter's placement, as an optimizer step would need; torch_tp completes
them at the end of backward; AsyncCollectiveTensors are waited; the same loop runs over
both). After the timed step, ``optimizer.step()`` runs (the example's
optimizer, ``llama_model.make_optimizer``: fused AdamW, here with a small lr)
and is timed on its own: reported are its median, its share of the training
step (step + optimizer) and the training step's DTensor / torch_tp ratio (json:
``optimizer_median_ms``, ``optimizer_share``, ``training_step_median_ms``,
``training_step_dtensor_over_torch_tp``). DTensor's time until ``backward()``
returned is reported beside it (json: ``until_backward_returned_median_ms``). Each rank times its own steps
(perf_counter; the optimizer's and backward's share as laps inside the
timed training step); after the run the times are gathered and a repeat's
time is the slowest rank's. Reported: median, p10, p90 over
repeats; DTensor / torch_tp is the ratio of the medians; the paired difference
is the median of the per-repeat differences. Cyclic GC is off while timing.
One more untimed step of each, under torch.profiler, counts the
collectives a step issues (``c10d::*`` events, and on the torch_tp backend the
ops' direct calls, ``torch_tp_backend::*``; by kind), which explains most
of the differences on a gloo group, where a collective costs far more than
the example's small GEMMs.

Targets, printed PASS/MISS:

* ``model`` (the example model at its default config): DTensor / torch_tp >= 1.5.
  At that size a step is framework cost and collectives, not math: a
  library that keeps DTensor off the hot path and issues fewer, cheaper
  collectives for the same plan should be at least that much faster, or
  a user has little reason to swap the import.
* ``block-large``, ``model-large``: torch_tp no slower, DTensor / torch_tp >= 1:
  where the GEMMs dominate, both run the same math on the same shards, and
  the speed-up at small sizes must not cost anything here.

Rank 0 writes ``tp_block.json`` (all figures, per-repeat times, machine),
``tp_block.png`` and the ``bench_tp_block`` section of ``RESULTS.md`` (text
outside its markers is kept) into ``--out-dir``, and prints the table.
"""
import argparse
import copy
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import torch_tp
from _common import (
    Output,
    add_output_args,
    add_repeat_scale_arg,
    bar_panel,
    check_everywhere,
    close,
    figure,
    materialize,
    method_notes,
    plot_title,
    rotations,
    run,
    save_figure,
    scaled_repeats,
    section_head,
    target_lines,
    time_interleaved,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(REPO_ROOT, "examples")


def import_example():
    """examples/llama_model.py's model, plan and loss helpers."""
    if EXAMPLES_DIR not in sys.path:
        sys.path.insert(0, EXAMPLES_DIR)
    try:
        import llama_model
    except Exception as e:
        raise RuntimeError(
            f"bench_tp_block: cannot import examples/llama_model.py ({type(e).__name__}: {e}); "
            "the benchmark takes its model and TP plan from there"
        ) from e
    return llama_model


# ---------------------------------------------------------------------------
# configurations


@dataclass
class Config:
    name: str
    kind: str  # "block" or "model"
    model: Dict[str, Any]  # LlamaConfig keyword arguments (the rest: its defaults)
    batch: int
    seq: int
    repeats: int  # full run
    quick_repeats: int
    warmup: int  # untimed steps per implementation after the check (which is one more)
    quick_warmup: int
    target: Optional[str] = None  # "example" (>= EXAMPLE_TARGET) or "large" (>= LARGE_TARGET)
    note: str = ""


# The example's defaults: LlamaConfig() and examples/train_llama.py's --batch 8 --seq 128.
EXAMPLE_MODEL: Dict[str, Any] = {}
EXAMPLE_BATCH, EXAMPLE_SEQ = 8, 128
LARGE_MODEL: Dict[str, Any] = {"dim": 512, "n_heads": 8}
LARGE_BATCH, LARGE_SEQ = 8, 256

# Repeats: fewer where a step is longer, so a full run takes minutes on 2 cores
# with 2 ranks (setup and checks included); --quick is a smoke run.
CONFIGS: List[Config] = [
    Config("block", "block", EXAMPLE_MODEL, EXAMPLE_BATCH, EXAMPLE_SEQ, 300, 30, 10, 3,
           note="one layer of the example model, per-layer plan"),
    Config("model", "model", EXAMPLE_MODEL, EXAMPLE_BATCH, EXAMPLE_SEQ, 120, 20, 5, 2, target="example",
           note="the example model at its default config, loss_parallel"),
    Config("block-large", "block", LARGE_MODEL, LARGE_BATCH, LARGE_SEQ, 40, 6, 2, 1, target="large",
           note="one layer, dim 512, 8 heads, seq 256"),
    Config("model-large", "model", {**LARGE_MODEL, "n_layers": 4}, 2, LARGE_SEQ, 20, 5, 1, 0, target="large",
           note="4 layers, dim 512, 8 heads, batch 2, seq 256, loss_parallel"),
]
CONFIG_NAMES = [c.name for c in CONFIGS]

IMPLS = ["torch_tp", "dtensor"]
COMPILED = "torch_tp_compiled"  # with --compile
IMPL_LABELS = {
    "torch_tp": "torch_tp (torch_tp.parallelize_module + torch_tp styles, torch_tp.loss_parallel)",
    "dtensor": "DTensor TP (torch.distributed.tensor.parallel, same plan, torch's loss_parallel)",
    COMPILED: "torch_tp with every transformer block compiled, block.compile(fullgraph=True) (torchtitan's "
    "recipe; block configs: the block)",
}


def impls_of(args: argparse.Namespace) -> List[str]:
    return IMPLS + [COMPILED] if args.compile else list(IMPLS)


RTOL = 1e-4  # fp32
ATOL_SCALE = 1e-5  # atol = this * max |reference| (per tensor)
EXAMPLE_TARGET = 1.5  # DTensor / torch_tp on the example model
LARGE_TARGET = 1.0  # DTensor / torch_tp at the large sizes ("no slower")


def output_tag(backend: str, compiled: bool) -> str:
    """The RESULTS.md section's marker tag."""
    tag = "bench_tp_block" if backend == "gloo" else f"bench_tp_block backend={backend}"
    return tag + (" compile" if compiled else "")


def output_stem(backend: str, compiled: bool) -> str:
    stem = "tp_block" if backend == "gloo" else f"tp_block_{backend}"
    return stem + ("_compile" if compiled else "")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_tp_block.py",
        description=(
            "Time forward+backward steps of examples/llama_model.py's Llama (one transformer block, and the "
            "whole model) under its sequence-parallel TP plan, applied by torch_tp and by torch's DTensor "
            "tensor parallelism, side by side in one torchrun job (gloo by default, CPU, float32)."
        ),
    )
    add_output_args(p, "tp_block.json, tp_block.png", quick="smoke run: every configuration, a few repeats")
    p.add_argument("--configs", default=None,
                   help="comma-separated subset of " + ",".join(CONFIG_NAMES) + " (default: all)")
    add_repeat_scale_arg(p, "configuration")
    p.add_argument("--optimizer", choices=["fused", "for-loop"], default="fused",
                   help="the AdamW timed after each step: the example's fused one (default), or torch's for-loop "
                   "implementation (foreach=False: one DTensor dispatch per parameter and op)")
    p.add_argument("--backend", choices=["gloo", "torch_tp"], default="gloo",
                   help="process-group backend for both implementations (default: %(default)s; torch_tp writes "
                   "tp_block_torch_tp.* and its own RESULTS.md section)")
    p.add_argument("--compile", action="store_true",
                   help="also time torch_tp with every transformer block compiled (block.compile(fullgraph=True), "
                   "torchtitan's recipe; block configs: the block itself) against eager torch_tp and DTensor; "
                   "writes tp_block_compile.* (tp_block_torch_tp_compile.*) and its own RESULTS.md section")
    args = p.parse_args(argv)
    if args.configs:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = [n for n in names if n not in CONFIG_NAMES]
        if unknown or not names:
            p.error(f"--configs: unknown {unknown}; choose from {CONFIG_NAMES}")
        args.configs = [c for c in CONFIGS if c.name in names]
    else:
        args.configs = list(CONFIGS)
    return args


# ---------------------------------------------------------------------------
# helpers


def gather_pieces(local: torch.Tensor, dim: int, full_len: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor from every rank's torch.chunk piece along ``dim`` (plain dist.all_gather, padded)."""
    world = group.size()
    lengths = [torch_tp.chunk_range(full_len, world, r)[1] for r in range(world)]
    size = lengths[0]  # every piece padded to the first, the longest
    if local.size(dim) != lengths[group.rank()]:
        raise AssertionError(f"piece of length {local.size(dim)} on dim {dim}, expected {lengths[group.rank()]}")
    shape = list(local.shape)
    shape[dim] = size
    buf = local.new_zeros(shape)
    buf.narrow(dim, 0, local.size(dim)).copy_(local)
    outs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(outs, buf, group=group)
    return torch.cat([o.narrow(dim, 0, n) for o, n in zip(outs, lengths)], dim=dim)


# ---------------------------------------------------------------------------
# one configuration: the unsharded model and the two parallelized copies


class Case:
    """One configuration on one mesh: ``steps[impl]()`` runs one timed step and returns its loss;
    ``resets[impl]()`` sets the gradients to None (untimed); ``check()`` is NOTE [same computation]."""

    def __init__(self, cfg: Config, lm, mesh: DeviceMesh, optimizer: str, impls: List[str]) -> None:
        self.cfg = cfg
        self.lm = lm
        self.mesh = mesh
        self.group = mesh.get_group()
        world, rank = self.group.size(), self.group.rank()
        self.llama_config = lm.LlamaConfig(**{**cfg.model, "max_seq_len": max(cfg.seq, 512)})
        lm.check_tp_degree(self.llama_config, world)
        if cfg.seq % world:
            raise ValueError(f"{cfg.name}: sequence length {cfg.seq} must be a multiple of the world size {world}")
        self.impls = impls
        self.apis = {impl: lm.load_tp_api("torch" if impl == "dtensor" else "torch_tp") for impl in impls}

        torch.manual_seed(1234)  # the same unsharded weights on every rank
        gen = torch.Generator().manual_seed(4321)  # the same batch on every rank
        c = self.llama_config
        if cfg.kind == "model":
            self.reference: nn.Module = lm.Llama(c)
            tokens = torch.randint(0, c.vocab_size, (cfg.batch, cfg.seq + 1), generator=gen)
            self.inputs, self.targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        else:
            # A block of the model, with the model's initialisation (layer 0).
            self.reference = lm.Llama(lm.LlamaConfig(**{**c.to_dict(), "n_layers": 1})).layers["0"]
            self.rope = lm.precompute_rope(c.head_dim, c.max_seq_len, c.rope_theta)
            # Inputs of the scale of an embedding's output (unit normal, as tok_embeddings' init).
            self.x_full = torch.randn(cfg.batch, cfg.seq, c.dim, generator=gen)
            self.x_local = self.x_full.chunk(world, dim=1)[rank].contiguous()

        self.models: Dict[str, nn.Module] = {}
        self.xs: Dict[str, torch.Tensor] = {}
        for impl, api in self.apis.items():
            m = copy.deepcopy(self.reference)
            plan = lm.tp_plan(api)
            if cfg.kind == "block":
                prefix = "layers.*."
                plan = {k[len(prefix):]: v for k, v in plan.items() if k.startswith(prefix)}
            api.parallelize_module(m, mesh, plan)
            if impl == COMPILED:
                for block in (m.layers.values() if cfg.kind == "model" else [m]):
                    block.compile(fullgraph=True)
            self.models[impl] = m
            if cfg.kind == "block":
                self.xs[impl] = self.x_local.clone().requires_grad_()
        self.plan_keys = sorted(plan)
        names = {impl: [n for n, _ in m.named_parameters()] for impl, m in self.models.items()}
        ref_names = [n for n, _ in self.reference.named_parameters()]
        for impl, n in names.items():
            if n != ref_names:
                raise AssertionError(f"{cfg.name}: {impl}'s parameter names differ from the unsharded model's: "
                                     f"{n} vs {ref_names}")
        self.param_names = ref_names
        self.n_params = sum(p.numel() for p in self.reference.parameters())
        self.outputs: Dict[str, torch.Tensor] = {}  # block: the last step's output, for the check
        self.backward_done: Dict[str, float] = {}  # perf_counter when loss.backward() returned, last step
        self.steps: Dict[str, Callable[[], torch.Tensor]] = {impl: self._make_step(impl) for impl in impls}
        self.resets: Dict[str, Callable[[], None]] = {impl: self._make_reset(impl) for impl in impls}
        # The example's optimizer (examples/train_llama.py: fused AdamW), stepped after each timed forward +
        # backward; a small lr keeps hundreds of repeats well away from divergence.
        self.optimizers = {impl: lm.make_optimizer(m, lr=1e-5) if optimizer == "fused" else
                           torch.optim.AdamW(m.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1,
                                             foreach=False)
                           for impl, m in self.models.items()}

    # -- the timed step

    def _make_step(self, impl: str) -> Callable[[], torch.Tensor]:
        model, api, lm = self.models[impl], self.apis[impl], self.lm
        params = list(model.parameters())
        outputs, backward_done = self.outputs, self.backward_done
        perf_counter = time.perf_counter

        def finish() -> None:
            """NOTE [complete gradients]: the step ends when every parameter holds its gradient.

            torch_tp's gradients are complete when backward returns (one all-reduce at the
            end of backward completes the norm weights' partial gradients).
            DTensor leaves those as ``Partial(sum)`` DTensors: pending sums over the
            ranks, which the optimizer (or clip_grad_norm_) would reduce before using
            them. Reduce them here, as DTensor itself does (``redistribute`` to the
            parameter's placements), and wait for any AsyncCollectiveTensor."""
            for p in params:
                g = p.grad
                if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                    p.grad = g = g.redistribute(p.device_mesh, p.placements)
                materialize(g)

        if self.cfg.kind == "model":
            inputs, targets = self.inputs, self.targets

            def step() -> torch.Tensor:
                with api.loss_parallel():
                    loss = lm.cross_entropy_loss(model(inputs), targets)
                    loss.backward()
                backward_done[impl] = perf_counter()
                finish()
                return loss

            return step

        x, rope = self.xs[impl], self.rope
        numel = self.x_full.numel()

        def step() -> torch.Tensor:
            out = model(x, rope)  # this rank's sequence shard [b, s/p, d], a plain tensor
            loss = out.square().sum() / numel  # this rank's part of the global mean square
            loss.backward()
            backward_done[impl] = perf_counter()
            finish()
            materialize(x.grad)
            outputs[impl] = out
            return loss

        return step

    def _make_reset(self, impl: str) -> Callable[[], None]:
        model, x = self.models[impl], self.xs.get(impl)

        def reset() -> None:
            model.zero_grad(set_to_none=True)
            if x is not None:
                x.grad = None

        return reset

    # -- NOTE [same computation]

    def _full_grads_torch_tp(self, impl: str) -> Dict[str, torch.Tensor]:
        """Every parameter's full gradient; torch_tp's gradients must already be complete (each with its
        parameter's placements: no Partial left after backward). The collectives all run first (the same on
        every rank), the comparisons after, so a rank that fails one does not leave the other waiting."""
        out = {}
        params = list(self.models[impl].named_parameters())
        missing = [name for name, p in params if p.grad is None]
        if missing:  # the same parameters on every rank: every rank raises
            raise AssertionError(f"{impl}: no gradient for {missing}")
        for name, p in params:
            g = p.grad
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
        for name, p in params:
            if isinstance(p, DTensor) and p.grad.placements != p.placements:
                raise AssertionError(f"{impl}: {name}'s gradient is {p.grad.placements}, its parameter "
                                     f"{p.placements}")
        return out

    def _full_grads_dtensor(self) -> Dict[str, torch.Tensor]:
        out = {}
        for name, p in self.models["dtensor"].named_parameters():
            g = materialize(p.grad)
            if g is None:
                raise AssertionError(f"DTensor: {name} has no gradient")
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
        return out

    def _reference_step(self) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        ref = self.reference
        ref.zero_grad(set_to_none=True)
        extra: Dict[str, torch.Tensor] = {}
        if self.cfg.kind == "model":
            loss = self.lm.cross_entropy_loss(ref(self.inputs), self.targets)
            loss.backward()
        else:
            x = self.x_full.clone().requires_grad_()
            out = ref(x, self.rope)
            loss = out.square().sum() / out.numel()
            loss.backward()
            extra = {"output": out.detach(), "x.grad": x.grad}
        grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        return loss.detach(), grads, extra

    def check(self) -> Dict[str, float]:
        """Run one step of each and compare; returns the largest relative difference per pair."""
        losses, grads, extras = {}, {}, {}
        for impl in self.impls:
            self.resets[impl]()
            loss = self.steps[impl]()
            loss_full = lm_to_full(loss).detach().clone()
            if self.cfg.kind == "block":  # per-rank parts of the global loss
                dist.all_reduce(loss_full, group=self.group)
                out = materialize(self.outputs[impl]).detach()
                extras[impl] = {
                    "output": gather_pieces(out, 1, self.cfg.seq, self.group),
                    "x.grad": gather_pieces(materialize(self.xs[impl].grad).detach(), 1, self.cfg.seq, self.group),
                }
            losses[impl] = loss_full
            grads[impl] = self._full_grads_dtensor() if impl == "dtensor" else self._full_grads_torch_tp(impl)
            self.resets[impl]()
        ref_loss, ref_grads, ref_extra = self._reference_step()
        losses["reference"], grads["reference"], extras["reference"] = ref_loss, ref_grads, ref_extra
        worst = {}
        pairs = [("torch_tp", "dtensor"), ("torch_tp", "reference"), ("dtensor", "reference")]
        if COMPILED in self.impls:
            pairs += [(COMPILED, "torch_tp"), (COMPILED, "reference")]
        for a, b in pairs:
            what = f"{self.cfg.name}: {a} vs {b}"
            # atol on each tensor's own scale, never an absolute floor (close's default): some gradients here
            # are tiny (the norm weights' under a mean loss), which a fixed atol of 1e-5 would let through
            # however wrong.
            rel = close(losses[a], losses[b], f"{what}: loss", RTOL, ATOL_SCALE)
            if set(grads[a]) != set(grads[b]):
                raise AssertionError(f"{what}: gradient names differ: {sorted(grads[a])} vs {sorted(grads[b])}")
            for name in grads[b]:
                rel = max(rel, close(grads[a][name], grads[b][name], f"{what}: grad of {name}", RTOL, ATOL_SCALE))
            for name in extras.get(b, {}):
                rel = max(rel, close(extras[a][name], extras[b][name], f"{what}: {name}", RTOL, ATOL_SCALE))
            worst[f"{a} vs {b}"] = rel
        self.loss_value = float(losses["reference"])
        self.outputs.clear()
        return worst


def collective_kind(op: str) -> str:
    """``c10d::_reduce_scatter_base_``, ``c10d::reduce_scatter_tensor_coalesced_`` -> ``reduce_scatter``, etc."""
    squeezed = op.replace("_", "")
    for kind in ("reduce_scatter", "all_gather", "all_reduce"):
        if kind.replace("_", "") in squeezed:
            return kind
    return op.strip("_")


def count_collectives(case: Case, impl: str) -> Dict[str, int]:
    """The collectives one step of ``impl`` issues on this rank, by kind (untimed; torch.profiler's
    ``c10d::*`` events, which every ProcessGroup call records, whoever calls it: torch_tp's C++ kernels or
    DTensor's functional collectives; and ``torch_tp_backend::*``, the torch_tp ops' direct calls into the
    torch_tp backend, which skip c10d: NOTE [direct calls from the ops] in process_group_shm.h)."""
    from torch.profiler import ProfilerActivity, profile

    case.resets[impl]()
    dist.barrier(group=case.group)
    # Kineto prints start/stop lines (and, without a GPU, an error about it) on fd 2: hide them.
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            case.steps[impl]()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    case.resets[impl]()
    case.outputs.clear()
    counts: Dict[str, int] = {}
    for e in prof.events():
        prefix = next((p for p in ("c10d::", "torch_tp_backend::") if e.name.startswith(p)), None)
        if prefix is None or "barrier" in e.name:
            continue
        kind = collective_kind(e.name[len(prefix):])
        counts[kind] = counts.get(kind, 0) + 1
    counts["total"] = sum(counts.values())
    return counts


def fmt_counts(c: Dict[str, int]) -> str:
    parts = [f"{v} {k.replace('_', '-')}" for k, v in sorted(c.items()) if k != "total"]
    return f"{c['total']} ({', '.join(parts)})"


def lm_to_full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a loss: DTensor (torch's loss_parallel: Replicate) or plain (torch_tp's)."""
    t = materialize(t)
    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------
# measurement


def training_step(case: Case, impl: str) -> Callable[[], Dict[str, float]]:
    """The timed step, then optimizer.step(); laps: where the step ended, where loss.backward() returned."""
    step, optimizer, backward_done = case.steps[impl], case.optimizers[impl], case.backward_done

    def run_step() -> Dict[str, float]:
        step()
        t_opt = time.perf_counter()
        optimizer.step()
        return {"step": t_opt, "backward": backward_done[impl]}

    return run_step


def bench(args: argparse.Namespace, lm, mesh: DeviceMesh, rank: int, world: int) -> List[Dict]:
    group = mesh.get_group()
    records = []
    for cfg in args.configs:
        t_cfg = time.perf_counter()
        impls = impls_of(args)
        case = Case(cfg, lm, mesh, args.optimizer, impls)
        # also the first (untimed) step of each
        agreement = check_everywhere(
            case.check,
            f"bench_tp_block: torch_tp, DTensor and the unsharded model disagree on {case.cfg.name}",
            group,
        )
        collectives = {impl: count_collectives(case, impl) for impl in impls}  # rank 0's go in the json
        t_checked = time.perf_counter()
        repeats = scaled_repeats(cfg.quick_repeats if args.quick else cfg.repeats, args.repeat_scale)
        warmup = cfg.quick_warmup if args.quick else cfg.warmup

        samples = time_interleaved({impl: training_step(case, impl) for impl in impls}, repeats, group,
                                   order=rotations(impls), reset=case.resets, warmup=warmup)
        case.outputs.clear()
        for impl in impls:  # optimizer.step() alone, per rank: the training step less the step
            samples.per_rank[f"{impl}/optimizer"] = samples.per_rank[impl] - samples.per_rank[f"{impl}/step"]
        elapsed = time.perf_counter() - t_cfg

        c = case.llama_config
        rec: Dict[str, Any] = {
            "config": cfg.name,
            "kind": cfg.kind,
            "note": cfg.note,
            "target": cfg.target,
            "model_config": c.to_dict() if cfg.kind == "model" else {**c.to_dict(), "n_layers": 1},
            "ffn_hidden_dim": c.ffn_hidden_dim,
            "batch": cfg.batch,
            "seq": cfg.seq,
            "params": case.n_params,
            "plan_keys": case.plan_keys,
            "loss": case.loss_value,
            "repeats": repeats,
            "warmup": warmup,
            "check_max_rel_diff": agreement,
            "collectives_per_step": collectives,
            "setup_and_check_s": t_checked - t_cfg,
            "elapsed_s": elapsed,
            "impls": {},
        }
        for impl in impls:
            st = samples.stats(f"{impl}/step", "ms")
            st["tokens_per_s"] = cfg.batch * cfg.seq / (st["median_ms"] / 1e3)
            # Until loss.backward() returned, before NOTE [complete gradients] (DTensor: norm grads Partial).
            st["until_backward_returned_median_ms"] = samples.median(f"{impl}/backward", "ms")
            st["optimizer_median_ms"] = samples.median(f"{impl}/optimizer", "ms")
            st["training_step_median_ms"] = samples.median(impl, "ms")
            st["optimizer_share"] = st["optimizer_median_ms"] / st["training_step_median_ms"]
            rec["impls"][impl] = st
        med = {k: rec["impls"][k]["median_ms"] for k in impls}
        rec["dtensor_over_torch_tp"] = med["dtensor"] / med["torch_tp"]
        rec["training_step_dtensor_over_torch_tp"] = (rec["impls"]["dtensor"]["training_step_median_ms"]
                                                      / rec["impls"]["torch_tp"]["training_step_median_ms"])
        if COMPILED in impls:  # how many times faster compiled blocks make torch_tp's step
            rec["eager_over_compiled"] = med["torch_tp"] / med[COMPILED]
            rec["dtensor_over_compiled"] = med["dtensor"] / med[COMPILED]
        diffs = samples.paired_stats("dtensor/step", "torch_tp/step", "ms")
        rec["dtensor_minus_torch_tp_ms"] = diffs["median_ms"]
        rec["dtensor_minus_torch_tp_p10_p90_ms"] = [diffs["p10_ms"], diffs["p90_ms"]]
        records.append(rec)
        if rank == 0:
            print(
                f"[bench_tp_block] {cfg.name:>11}: checked (max rel. diff {max(agreement.values()):.1e}), "
                f"{repeats} repeats x {len(impls)} impls in {elapsed:.1f} s; "
                + ", ".join(f"{k} {med[k]:.2f} ms" for k in impls)
                + f"; DTensor / torch_tp {rec['dtensor_over_torch_tp']:.2f}",
                flush=True,
            )
        del case
    return records


# ---------------------------------------------------------------------------
# reporting


def fmt_ms(ms: float) -> str:
    return f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def describe(rec: Dict) -> str:
    m = rec["model_config"]
    what = "1 block" if rec["kind"] == "block" else f"{m['n_layers']} layers, vocab {m['vocab_size']}"
    return (f"{what}, dim {m['dim']}, {m['n_heads']} heads, ffn {rec['ffn_hidden_dim']}; "
            f"batch {rec['batch']} x seq {rec['seq']}")


def markdown_table(records: List[Dict]) -> str:
    lines = [
        "| config | shape | torch_tp ms (p10-p90) | DTensor ms (p10-p90) | DTensor / torch_tp "
        "| DTensor - torch_tp ms (paired) | DTensor ms until backward() returns "
        "| optimizer.step() ms, torch_tp / DTensor (share of the training step) "
        "| training step (+ optimizer) DTensor / torch_tp | repeats |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        im = rec["impls"]
        cells = [
            f"{fmt_ms(im[k]['median_ms'])} ({fmt_ms(im[k]['p10_ms'])}-{fmt_ms(im[k]['p90_ms'])})" for k in IMPLS
        ]
        lines.append(
            f"| {rec['config']} | {describe(rec)} | {cells[0]} | {cells[1]} | "
            f"**{rec['dtensor_over_torch_tp']:.2f}** | {rec['dtensor_minus_torch_tp_ms']:+.2f} | "
            f"{fmt_ms(im['dtensor']['until_backward_returned_median_ms'])} | "
            f"{fmt_ms(im['torch_tp']['optimizer_median_ms'])} ({100 * im['torch_tp']['optimizer_share']:.0f}%) / "
            f"{fmt_ms(im['dtensor']['optimizer_median_ms'])} ({100 * im['dtensor']['optimizer_share']:.0f}%) | "
            f"{rec['training_step_dtensor_over_torch_tp']:.2f} | {rec['repeats']} |"
        )
    return "\n".join(lines)


def compiled_table(records: List[Dict]) -> str:
    """With --compile: torch_tp with compiled blocks against eager torch_tp and DTensor."""
    lines = [
        "| config | torch_tp eager ms | torch_tp compiled blocks ms (p10-p90) | eager / compiled "
        "| DTensor / compiled | compiled training step (+ optimizer) ms |",
        "|:---|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        im = rec["impls"]
        c = im[COMPILED]
        lines.append(
            f"| {rec['config']} | {fmt_ms(im['torch_tp']['median_ms'])} | "
            f"{fmt_ms(c['median_ms'])} ({fmt_ms(c['p10_ms'])}-{fmt_ms(c['p90_ms'])}) | "
            f"**{rec['eager_over_compiled']:.2f}** | {rec['dtensor_over_compiled']:.2f} | "
            f"{fmt_ms(c['training_step_median_ms'])} |"
        )
    return "\n".join(lines)


def collectives_lines(records: List[Dict]) -> List[str]:
    short = {"torch_tp": "torch_tp", "dtensor": "DTensor", COMPILED: "torch_tp compiled"}
    return [
        f"- {rec['config']}: " + "; ".join(f"{short[k]} {fmt_counts(c)}" for k, c in rec["collectives_per_step"].items())
        for rec in records
    ]


def evaluate_targets(records: List[Dict]) -> List[Dict]:
    targets = []
    for rec in records:
        ratio = rec["dtensor_over_torch_tp"]
        im = rec["impls"]
        value = (f"torch_tp {fmt_ms(im['torch_tp']['median_ms'])} ms vs DTensor "
                 f"{fmt_ms(im['dtensor']['median_ms'])} ms per step: DTensor / torch_tp = {ratio:.2f}")
        if rec["target"] == "example":
            targets.append({
                "config": rec["config"],
                "target": f"{rec['config']} (the example model, default config): torch_tp at least "
                f"{EXAMPLE_TARGET:g}x faster per step",
                "value": value,
                "pass": ratio >= EXAMPLE_TARGET,
            })
        elif rec["target"] == "large":
            targets.append({
                "config": rec["config"],
                "target": f"{rec['config']} ({describe(rec)}): torch_tp no slower than DTensor",
                "value": value,
                "pass": ratio >= LARGE_TARGET,
            })
    return targets


def plot(path: str, report: Dict) -> None:
    records = report["results"]
    fig, axes = figure(1, len(records), (3.3, 3.9))
    colors = {"torch_tp": "C0", "dtensor": "C1", COMPILED: "C2"}
    short = {"torch_tp": "torch_tp", "dtensor": "DTensor", COMPILED: "torch_tp\ncompiled"}
    for ax, rec in zip(axes.flat, records):
        im = rec["impls"]
        bar_panel(ax, [short[k] for k in im], [colors[k] for k in im], list(im.values()), "ms",
                  f"{rec['config']}: DTensor / torch_tp = {rec['dtensor_over_torch_tp']:.2f}\n"
                  f"dim {rec['model_config']['dim']}, b{rec['batch']} x s{rec['seq']}",
                  "fwd+bwd step, ms (median; p10-p90)", title_size=8)
    save_figure(fig, path, "Llama TP step (fwd+bwd), " + plot_title(report), title_size=9)


def results_section(report: Dict) -> List[str]:
    m, records, compiled = report["machine"], report["results"], report["compile"]
    stem = output_stem(m["backend"], compiled)
    on = "" if m["backend"] == "gloo" else f", both on the {m['backend']} backend"
    compiled_lines = [
        "torch_tp with compiled blocks (`block.compile(fullgraph=True)` on every `TransformerBlock`, torchtitan's "
        "recipe; the embedding, final norm, output projection and loss stay eager; `block*`: the block compiled), "
        "timed in the same interleaved repeats, after the compilation (the check step and the warm-up):",
        "",
        compiled_table(records),
        "",
    ] if compiled else []
    return [
        *section_head(report, "## The example Llama under its TP plan: torch_tp vs DTensor TP, one block and the "
                      f"whole model{on}" + (", and torch_tp compiled" if compiled else ""),
                      " (`torch.set_num_threads(1)`)"),
        "Method: CPU float32. The model and plan are `examples/llama_model.py`'s (torchtitan's Llama and its "
        "sequence-parallel TP plan, `tp_plan(api)`), applied to deep copies of one unsharded model (same weights) "
        "by **torch_tp** (`torch_tp.parallelize_module`, torch_tp's styles, `torch_tp.loss_parallel`) and by "
        "**DTensor** (`torch.distributed.tensor.parallel.parallelize_module`, torch's styles and `loss_parallel`) on "
        f"`init_device_mesh(\"cpu\", ({m['world_size']},))`. A step is forward, loss and `loss.backward()` on a fixed "
        "batch, and ends when every parameter holds its complete gradient: DTensor leaves the SequenceParallel "
        "norm weights' gradients `Partial(sum)` (pending all-reduces an optimizer step would do); the step "
        "`redistribute`s them to the parameters' `Replicate()` (torch_tp completes them at the end of backward); "
        f"After it, `optimizer.step()` runs ({report['optimizer']} AdamW, lr 1e-5) and is timed on its own: its "
        "median, its share of the training step (step + optimizer) and the training step's ratio are in the "
        "table, beside DTensor's time until `backward()` returns. "
        "`model*`: `cross_entropy(model(inputs), targets)` inside `loss_parallel()` (vocab-sharded logits), as the example trains. `block*`: one `TransformerBlock` "
        "parallelized with the plan's `layers.*.` entries, fed this rank's sequence shard `x [b, s/p, d]` "
        "(requires grad), loss the rank's part of `mean(out**2)`. Before timing, every configuration checks "
        f"(`assert_close`, rtol {RTOL:.0e}, atol {ATOL_SCALE:.0e} x each tensor's max|ref|) that torch_tp, DTensor and the "
        "unsharded model (plain autograd) give the same loss and the same full gradient of every parameter "
        "(`full_tensor()`; torch_tp's already in its parameters' placements; block: also output and input gradient). "
        "Per repeat, one step of each implementation, the order alternating; gradients reset untimed; "
        "`dist.barrier()` before each timed step; the per-repeat time is the max over ranks; figures are medians "
        "over repeats (p10-p90 in brackets), DTensor / torch_tp the ratio of medians, the paired difference the "
        "median of per-repeat differences. GC off while timing.",
        "",
        markdown_table(records),
        "",
        *compiled_lines,
        "Collectives per step (one untimed step, rank 0, counted from torch.profiler's `c10d::*` and "
        "`torch_tp_backend::*` events; "
        "DTensor's include the reductions of its Partial gradients):",
        "",
        *collectives_lines(records),
        "",
        "Targets (DTensor / torch_tp is how many times faster torch_tp's step is):",
        "",
        *target_lines(report["targets"]),
        "",
        f"![step time per configuration]({stem}.png)",
        "",
        f"Raw figures, per-repeat times, per-rank medians and check differences: [{stem}.json]({stem}.json).",
    ]


# ---------------------------------------------------------------------------


def measure(args: argparse.Namespace, lm) -> Output:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    data: Dict[str, Any] = {
        "dtype": "float32",
        "optimizer": args.optimizer,
        "compile": args.compile,
        "device": "cpu",
        "model_source": "examples/llama_model.py: Llama, LlamaConfig, tp_plan, cross_entropy_loss",
        "impls": {impl: IMPL_LABELS[impl] for impl in impls_of(args)},
        "targets_rule": {
            "example": f"model (default config): DTensor / torch_tp >= {EXAMPLE_TARGET:g}",
            "large": f"block-large, model-large: DTensor / torch_tp >= {LARGE_TARGET:g}",
        },
        "method": {
            "check": f"assert_close rtol {RTOL:g}, atol {ATOL_SCALE:g} * max|ref| (per tensor): loss and every "
            "parameter's full gradient, torch_tp vs DTensor vs the unsharded model (plain autograd); block: "
            "also gathered output and input gradient; torch_tp's gradients in their parameters' placements",
            "step": "forward + loss + loss.backward(); model: inside loss_parallel(); ends when every "
            "parameter holds its complete gradient: DTensor's Partial(sum) gradients (SequenceParallel norm "
            "weights) redistributed to the parameter's placements, AsyncCollectiveTensors waited",
            "optimizer": "optimizer.step() after the step (the example's fused AdamW, lr 1e-5), timed alone "
            "(max over ranks, median); training step = step + optimizer (per rank, then max over ranks); "
            "optimizer_share = optimizer median / training step median",
            "until_backward_returned": "the same step's time until loss.backward() returned (max over ranks, "
            "median): for DTensor, before its Partial gradients are reduced",
            "interleaved": "one step of each impl per repeat, order alternating",
            **method_notes("step"),
            "grad_reset": "zero_grad(set_to_none=True) before each step, untimed",
            "ratio": "DTensor median / torch_tp median",
            "paired_difference": "median over repeats of DTensor - torch_tp",
            "gc": "cyclic GC disabled during the timed steps",
        },
    }
    records = bench(args, lm, mesh, rank, world)
    targets = evaluate_targets(records)
    data.update(results=records, targets=targets)
    console = [markdown_table(records), ""]
    if args.compile:
        console += [compiled_table(records), ""]
    console += ["Collectives per step (one untimed step, rank 0):", *collectives_lines(records), "",
                "Targets:", *target_lines(targets)]
    return Output(tag=output_tag(args.backend, args.compile), stem=output_stem(args.backend, args.compile),
                  data=data, section=results_section, plot=plot, console=console)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    lm = import_example() if "RANK" in os.environ else None  # run() says how to launch otherwise
    return run("bench_tp_block", args, lambda: measure(args, lm), backend=args.backend)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
