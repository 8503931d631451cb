#!/usr/bin/env python3
"""Training steps of the example Llama (examples/llama_model.py) under its sequence-parallel TP plan, applied
by torch_tp and by torch's DTensor TP, side by side (CPU, float32, one thread per rank)."""

import sys
import time
from typing import Dict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import harness
import llama_model as lm  # examples/llama_model.py, on sys.path through harness

COMPILED = "torch_tp_compiled"
# name: (kind, LlamaConfig overrides, batch, seq, repeats, warmup). The example's defaults (LlamaConfig(),
# train_llama.py's batch 8 x seq 128), then GEMM-bound sizes; fewer repeats where a step is longer.
LARGE = {"dim": 512, "n_heads": 8}
CONFIGS = {
    "block": ("block", {}, 8, 128, 300, 10),
    "model": ("model", {}, 8, 128, 120, 5),
    "block-large": ("block", LARGE, 8, 256, 40, 2),
    "model-large": ("model", {**LARGE, "n_layers": 4}, 2, 256, 20, 1),
}


def block_plan(api):
    """The example plan's per-layer entries, as torchtitan parallelizes each block."""
    return {k[len("layers.*."):]: v for k, v in lm.tp_plan(api).items() if k.startswith("layers.*.")}


class Case:
    """One configuration: deep copies of one unsharded model (same weights on every rank), parallelized by
    each implementation; ``steps[impl]()`` is one timed training step, ``grads[impl]()`` the same without the
    optimizer, ``resets[impl]()`` the untimed reset."""

    def __init__(self, name: str, mesh, impls) -> None:
        kind, overrides, batch, seq, _, _ = CONFIGS[name]
        group = mesh.get_group()
        self.config = c = lm.LlamaConfig(**{**overrides, "max_seq_len": max(seq, 512)})
        lm.check_tp_degree(c, group.size())
        torch.manual_seed(1234)
        gen = torch.Generator().manual_seed(4321)
        if kind == "model":
            reference = lm.Llama(c)
            tokens = torch.randint(0, c.vocab_size, (batch, seq + 1), generator=gen)
            inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        else:  # layer 0 of a one-layer model, fed this rank's sequence shard of an embedding-scale input
            reference = lm.Llama(lm.LlamaConfig(**{**c.to_dict(), "n_layers": 1})).layers["0"]
            rope = lm.precompute_rope(c.head_dim, c.max_seq_len, c.rope_theta)
            x_full = torch.randn(batch, seq, c.dim, generator=gen)
            x_local = x_full.chunk(group.size(), dim=1)[group.rank()].contiguous()
        self.grads, self.steps, self.resets = {}, {}, {}
        for impl in impls:
            model, api = harness.parallelized(reference, mesh, impl, None if kind == "model" else block_plan)
            if impl == COMPILED:  # torchtitan's recipe: every block compiled, the rest eager
                for block in (model.layers.values() if kind == "model" else [model]):
                    block.compile(fullgraph=True)
            opt = lm.make_optimizer(model, lr=1e-5)  # small: hundreds of repeats stay far from divergence
            if kind == "model":
                x, loss_backward = None, self._model_loss(model, api, inputs, targets)
            else:
                x = x_local.clone().requires_grad_()
                loss_backward = self._block_loss(model, x, rope, x_full.numel())
            self.grads[impl], self.steps[impl] = self._step(model, opt, loss_backward)
            self.resets[impl] = self._reset(model, x)

    @staticmethod
    def _reset(model, x):
        def reset():
            model.zero_grad(set_to_none=True)
            if x is not None:
                x.grad = None
        return reset

    @staticmethod
    def _model_loss(model, api, inputs, targets):
        def run():  # loss and backward inside loss_parallel(), as the example trains (vocab-sharded logits)
            with api.loss_parallel():
                lm.cross_entropy_loss(model(inputs), targets).backward()
        return run

    @staticmethod
    def _block_loss(model, x, rope, numel):
        def run():  # this rank's part of the global mean square, so the ranks' losses add up to it
            (model(x, rope).square().sum() / numel).backward()
            harness.materialize(x.grad)
        return run

    @staticmethod
    def _step(model, optimizer, loss_backward):
        """``(grads, step)``: ``grads()`` is forward, loss, backward, until every parameter holds its complete
        gradient (:func:`harness.complete_grads`); ``step()`` is ``grads()`` then optimizer.step(), with the
        step's end and backward()'s return as laps."""
        params = list(model.parameters())
        t_backward = 0.0

        def grads() -> None:
            nonlocal t_backward
            loss_backward()
            t_backward = time.perf_counter()
            harness.complete_grads(params)

        def step() -> Dict[str, float]:
            grads()
            t_step = time.perf_counter()
            optimizer.step()
            return {"step": t_step, "backward": t_backward}

        return grads, step


def count_collectives(case: Case, impl: str) -> str:
    """The collectives one untimed step issues on this rank, by kind (:func:`harness.collective_op`)."""
    case.resets[impl]()
    prof = harness.profile(case.grads[impl], 1)
    counts: Dict[str, int] = {}
    for e in prof.events():
        op = harness.collective_op(e.name).replace("_", "")
        if op:
            # _reduce_scatter_base_, reduce_scatter_tensor_coalesced_ ... -> reduce-scatter
            kind = next((k for k in ("reducescatter", "allgather", "allreduce", "alltoall") if k in op), op)
            counts[kind] = counts.get(kind, 0) + 1
    return f"{sum(counts.values())} (" + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ")"


def measure(args):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    impls = ["torch_tp", "dtensor"] + ([COMPILED] if args.compile else [])
    ratios = [("dtensor", "torch_tp")] + ([("torch_tp", COMPILED), ("dtensor", COMPILED)] if args.compile else [])
    table = harness.Table("ms", impls, ratios=ratios, paired=[("dtensor", "torch_tp")])
    notes = ["Collectives per step (one untimed step, rank 0, torch.profiler's `c10d::*` and "
             "`torch_tp_backend::*` events; DTensor's include the reductions of its Partial gradients):"]
    for name in args.configs:
        kind, _, batch, seq, repeats, warmup = CONFIGS[name]
        case = Case(name, mesh, impls)
        samples = harness.time_interleaved(case.steps, max(3, repeats // 10 if args.quick else repeats),
                                           reset=case.resets, warmup=1 + (warmup // 3 if args.quick else warmup))
        # after the timed steps: a first step may issue one-time collectives (set-up, shard sizes)
        collectives = {impl: count_collectives(case, impl) for impl in impls}
        keys = {impl: f"{impl}/step" for impl in impls}
        extra = {}
        for impl in impls:  # the lap at the step's end splits the training step into step and optimizer
            samples.per_rank[f"{impl}/optimizer"] = samples.per_rank[impl] - samples.per_rank[f"{impl}/step"]
            extra[f"{impl} optimizer.step() ms"] = samples.median(f"{impl}/optimizer", "ms")
            extra[f"{impl} training step ms"] = samples.median(impl, "ms")
        extra["dtensor until backward() returned ms"] = samples.median("dtensor/backward", "ms")
        c = case.config
        shape = (f"{'1 block' if kind == 'block' else f'{c.n_layers} layers, vocab {c.vocab_size}'}, dim {c.dim}, "
                 f"{c.n_heads} heads, ffn {c.ffn_hidden_dim}; batch {batch} x seq {seq}")
        table.add({"config": name, "shape": shape}, samples, keys, extra)
        notes.append(f"- {name}: " + "; ".join(f"{impl} {n}" for impl, n in collectives.items()))
        del case
    backend = "" if args.backend == "gloo" else f" backend={args.backend}"
    suffix = ("" if args.backend == "gloo" else f"_{args.backend}") + ("_compile" if args.compile else "")
    return {
        "tag": "bench_tp_block" + backend + (" compile" if args.compile else ""),
        "stem": "tp_block" + suffix,
        "title": "The example Llama under its TP plan: torch_tp vs DTensor TP"
        + (f", both on the {args.backend} backend" if backend else "") + (", and torch_tp compiled" if args.compile
                                                                          else ""),
        "about": "CPU float32. `examples/llama_model.py`'s model and `tp_plan(api)` applied to copies of one "
        "model by **torch_tp** (`torch_tp.parallelize_module`, its styles and `loss_parallel`) and **dtensor** "
        "(`torch.distributed.tensor.parallel`, torch's `loss_parallel`)"
        + (f"; **{COMPILED}**: torch_tp with `block.compile(fullgraph=True)` on every block" if args.compile else "")
        + ". `model*`: `cross_entropy` inside `loss_parallel()`; `block*`: one block on this rank's sequence "
        "shard, loss its part of `mean(out**2)`. A step is forward, loss, backward, until every parameter holds "
        "its complete gradient (DTensor's Partial norm-weight gradients redistributed); cells time it. "
        "Then `optimizer.step()` (fused AdamW, lr 1e-5), timed on its own; training step = both.",
        "tables": [table],
        "notes": ["\n".join(notes)],
    }


if __name__ == "__main__":
    p = harness.parser(__doc__, quick="smoke run: every configuration, a tenth of the repeats", backend="gloo",
                       configs=CONFIGS)
    p.add_argument("--compile", action="store_true",
                   help="also time torch_tp with every block compiled (block.compile(fullgraph=True)); writes "
                   "tp_block[_torch_tp]_compile.*")
    sys.exit(harness.run(p.parse_args(), measure))
