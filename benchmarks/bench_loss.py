#!/usr/bin/env python3
"""Vocab-parallel cross entropy: torch_tp's loss_parallel vs torch's vs the unsharded loss, on logits as
``ColwiseParallel(use_local_output=False)`` hands them over (NOTE [vocab-parallel cross entropy]). Gradients
are checked against the float64 loss's, since the unsharded float32 loss is itself off (one float32 sum of
exp over all classes). At LLM vocabularies the loss is bound by passes over the logits, so ``unsharded /
torch_tp`` would ideally be the rank count."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

import harness
import torch_tp

IMPLS = ["unsharded", "torch_tp", "dtensor"]
VOCABS = [256, 32000, 128256]  # the example model's bytes (the loss is per-call cost there), Llama 2's, Llama 3's
TOKENS, DTYPES = 512, ["float32", "bfloat16"]


def _step(loss_context, logits, target):
    def step():
        with loss_context():
            F.cross_entropy(logits, target).backward()
        out, logits.grad = logits.grad, None
        return out
    return step


def measure(args):
    p, rank, repeats = dist.get_world_size(), dist.get_rank(), 3 if args.quick else 12
    mesh = init_device_mesh("cpu", (p,))
    table = harness.Table("ms", IMPLS, ratios=[("unsharded", "torch_tp"), ("dtensor", "torch_tp")])
    for vocab in VOCABS:
        for dtype_name in DTYPES:
            dtype, gen = getattr(torch, dtype_name), torch.Generator().manual_seed(vocab)
            full = torch.randn(TOKENS, vocab, generator=gen).mul_(3).to(dtype)
            target = torch.randint(0, vocab, (TOKENS,), generator=gen)
            sharded = distribute_tensor(full, mesh, [Shard(1)]).detach().requires_grad_()
            whole = full.clone().requires_grad_()
            steps = {"torch_tp": _step(torch_tp.loss_parallel, sharded, target),
                     "dtensor": _step(torch_loss_parallel, sharded, target),
                     "unsharded": _step(lambda: torch.enable_grad(), whole, target) if rank == 0 else (lambda: None)}
            exact = full.double().requires_grad_()
            F.cross_entropy(exact, target).backward()
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            for impl in ("torch_tp", "dtensor"):
                grad = steps[impl]().full_tensor()
                err = float((grad.double() - exact.grad).abs().max() / exact.grad.abs().max()) if rank == 0 else 0
                if err > tol:
                    raise AssertionError(f"{impl} gradient ({vocab}, {dtype_name}) differs from the float64 loss's "
                                         f"by {err:.2e} (tolerance {tol:.0e})")
            del exact
            samples = harness.time_interleaved(steps, repeats, order=harness.permutations(IMPLS), warmup=1)
            logits_mib = TOKENS * vocab * full.element_size() / 2**20
            table.add({"vocab": vocab, "dtype": dtype_name}, samples, extra={"logits MiB": logits_mib})
            del full, sharded, whole, steps
    return {
        "tag": "bench_loss", "stem": "loss",
        "title": "Vocab-parallel cross entropy: torch_tp vs torch's loss_parallel vs unsharded",
        "about": f"CPU, eager, {args.backend} backend, {p} ranks, one intra-op thread. Logits [{TOKENS}, vocab] as a "
        "leaf DTensor sharded on the class dim; a step is `F.cross_entropy` (mean) forward and backward. **torch_tp**: "
        "inside `torch_tp.loss_parallel()`; **dtensor**: inside torch's `loss_parallel()`; **unsharded**: "
        "`F.cross_entropy` on the whole logits on rank 0 alone. Gradients checked against the float64 loss's on the "
        "whole logits before timing (1e-5 float32, 2e-2 bfloat16, of the largest magnitude).",
        "tables": [table]}


if __name__ == "__main__":
    sys.exit(harness.run(harness.parser(__doc__, quick="smoke run: 3 repeats per case", backend="torch_tp")
                         .parse_args(), measure))
