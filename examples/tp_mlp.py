"""Train a tensor-parallel MLP with the torch_tp ops and check it step by step.

Launch:  torchrun --nproc-per-node 2 examples/tp_mlp.py [--steps 30] [--backend gloo]

The block is Megatron's MLP, y = gelu(x @ W1^T + b1) @ W2^T + b2, with W1 split
by rows (column-parallel: each rank computes its torch.chunk share of the
4h features) and W2 by columns (row-parallel: each rank holds a partial sum of
y). It runs two ways:

  tensor parallel     x [b, s, h] replicated
                      column_parallel_linear(x, W1_r, b1_r) -> gelu
                      -> row_parallel_linear(., W2_r, b2)        (all-reduce inside)
  sequence parallel   x [b, s/p, h] sharded along the sequence
                      column_parallel_linear(x, W1_r, b1_r, gather_dim=1)
                      -> gelu -> row_parallel_linear(., W2_r, b2, scatter_dim=1)  (y [b, s/p, h])

Every rank also trains the unsharded MLP on the same data, and the example
checks after each SGD step that the losses agree and, at the end, that each
rank's weight shards equal the reference's. It exits non-zero on a mismatch.
"""

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_tp
from torch_tp import ops

# fp32 GEMMs and reductions in another order than the reference: roundoff
# grows with the steps, so this stays well above fp32 epsilon (1.2e-7).
RTOL = 1e-4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="SGD steps per mode (default 30)")
    parser.add_argument("--hidden", type=int, default=64, help="model width h; the MLP is h -> 4h -> h")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32, help="sequence length (any: uneven shards are fine)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend (default gloo)")
    return parser.parse_args()


def make_reference(hidden, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(4 * hidden, hidden, generator=gen) / hidden**0.5
    b1 = torch.randn(4 * hidden, generator=gen) * 0.1
    w2 = torch.randn(hidden, 4 * hidden, generator=gen) / (4 * hidden) ** 0.5
    b2 = torch.randn(hidden, generator=gen) * 0.1
    return [t.requires_grad_() for t in (w1, b1, w2, b2)]


def shard(params, group):
    """This rank's pieces: W1 rows and b1 (column-parallel), W2 columns (row-parallel), b2 whole."""
    w1, b1, w2, b2 = (t.detach() for t in params)
    pieces = [ops.shard(w1, 0, group), ops.shard(b1, 0, group), ops.shard(w2, 1, group), b2.clone()]
    return [t.requires_grad_() for t in pieces]


def batch(step, args):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen)
    target = torch.sin(x.roll(1, -1)) + 0.5 * x
    return x, target


def reference_loss(params, x, target):
    w1, b1, w2, b2 = params
    return F.mse_loss(F.gelu(x @ w1.t() + b1) @ w2.t() + b2, target)


def tp_loss(params, x, target, group):
    w1, b1, w2, b2 = params
    name = group.group_name
    h = F.gelu(torch.ops.torch_tp.column_parallel_linear(x, w1, b1, name))
    y = torch.ops.torch_tp.row_parallel_linear(h, w2, b2, name)
    return F.mse_loss(y, target)


def sp_loss(params, x, target, group):
    """Each rank sees only its sequence shard of x and of the target. Its loss
    term is the shard's share of the global mean; the sum over ranks is the
    global loss, and every parameter gradient the ops return is already the
    full one (the row layer's bias gradient comes from the gathered gradient)."""
    w1, b1, w2, b2 = params
    name = group.group_name
    x_shard, target_shard = ops.shard(x, 1, group), ops.shard(target, 1, group)
    h = F.gelu(torch.ops.torch_tp.column_parallel_linear(x_shard, w1, b1, name, 1, x.size(1)))
    y_shard = torch.ops.torch_tp.row_parallel_linear(h, w2, b2, name, 1)
    return F.mse_loss(y_shard, target_shard, reduction="sum") / target.numel()


def sgd_step(params, lr):
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
            p.grad = None


def train(mode, args, rank, group):
    reference = make_reference(args.hidden)
    sharded = shard(reference, group)
    worst = 0.0
    start = time.perf_counter()
    for step in range(args.steps):
        x, target = batch(step, args)
        ref = reference_loss(reference, x, target)
        ref.backward()
        sgd_step(reference, args.lr)

        if mode == "tensor parallel":
            loss = tp_loss(sharded, x, target, group)
            loss.backward()
        else:
            local = sp_loss(sharded, x, target, group)
            local.backward()
            loss = ops.all_reduce(local.detach(), "sum", group)
        sgd_step(sharded, args.lr)

        error = abs(loss.item() - ref.item()) / abs(ref.item())
        worst = max(worst, error)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"  [{mode}] step {step:3d}  loss {loss.item():.6f}  reference {ref.item():.6f}  rel. diff {error:.1e}")
    elapsed = time.perf_counter() - start

    expected = shard(reference, group)
    weight_error = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(sharded, expected))
    return worst, weight_error, elapsed


def main():
    args = parse_args()
    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if rank == 0:
        print(f"torch_tp {torch_tp.__version__} on torch {torch.__version__}: {world_size} ranks, "
              f"backend {args.backend}, MLP {args.hidden} -> {4 * args.hidden} -> {args.hidden}")

    failed = False
    for mode in ["tensor parallel", "sequence parallel"]:
        loss_error, weight_error, elapsed = train(mode, args, rank, group)
        errors = torch.tensor([loss_error, weight_error], dtype=torch.float64)
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        ok = bool((errors < RTOL).all())
        failed |= not ok
        if rank == 0:
            print(f"{mode}: {args.steps} steps in {elapsed:.2f} s; worst loss rel. diff {errors[0]:.1e}, "
                  f"weight shards rel. diff {errors[1]:.1e} (tolerance {RTOL:.0e}): {'OK' if ok else 'MISMATCH'}")

    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
