"""One rank of the two-node job that test_backend_faults.test_two_nodes launches.

Run by ``torchrun --nnodes 2 --nproc-per-node 2 ... backend_two_node_job.py OUT_DIR``
with ``TORCH_TP_HOST_KEY`` set differently for the two launches, so the
torch_tp backend places ranks {0, 1} and {2, 3} on different nodes. Every
collective runs on the torch_tp group and on a gloo group over the same ranks
(or against a value every rank can rebuild) and the differences are written to
``OUT_DIR/rank<r>.json``; the test reads them.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import torch_tp  # noqa: F401  (registers the backend)

# float32 sums over 4 ranks in another order than gloo's: a few roundings of O(1) terms.
TOL = dict(rtol=1e-6, atol=4e-6)


def main(out_dir):
    dist.init_process_group("torch_tp")
    rank, p = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    failures, checks = [], 0

    def data(seed, numel, dtype=torch.float32, who=rank):
        gen = torch.Generator().manual_seed(seed * 100 + who)
        return torch.randn(numel, generator=gen).to(dtype)

    def check(name, ours, theirs, exact=False, tol=TOL):
        nonlocal checks
        checks += 1
        try:
            if exact:
                assert torch.equal(ours, theirs), "not equal"
            else:
                torch.testing.assert_close(ours.double(), theirs.double(), **tol)
        except AssertionError as e:
            failures.append(f"{name}: {str(e)[:300]}")

    for numel in (0, 5, 16_384, 100_003):  # 100_003 floats: several 64 KiB buffers
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
            ours, theirs = data(1, numel), data(1, numel)
            dist.all_reduce(ours, op=op)
            dist.all_reduce(theirs, op=op, group=gloo)
            check(f"all_reduce {op} n={numel}", ours, theirs, exact=op == dist.ReduceOp.MAX)
        bf16 = data(2, numel, torch.bfloat16)
        dist.all_reduce(bf16)
        exact = torch.stack([data(2, numel, torch.bfloat16, r) for r in range(p)]).double().sum(0)
        check(f"all_reduce bf16 n={numel}", bf16, exact, tol=dict(rtol=2.0**-8, atol=1e-5))

        gathered, reference = torch.empty(p * numel), torch.empty(p * numel)
        dist.all_gather_into_tensor(gathered, data(3, numel))
        dist.all_gather_into_tensor(reference, data(3, numel), group=gloo)
        check(f"all_gather n={numel}", gathered, reference, exact=True)

        ours, theirs = torch.empty(numel), torch.empty(numel)
        dist.reduce_scatter_tensor(ours, data(4, p * numel))
        dist.reduce_scatter_tensor(theirs, data(4, p * numel), group=gloo)
        check(f"reduce_scatter n={numel}", ours, theirs)
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.AVG):
            ours, theirs = torch.empty(numel), torch.empty(numel)
            dist.reduce_scatter(ours, list(data(4, p * numel).chunk(p)), op=op)
            dist.reduce_scatter(theirs, list(data(4, p * numel).chunk(p)), op=op, group=gloo)
            check(f"reduce_scatter list {op} n={numel}", ours, theirs, exact=op == dist.ReduceOp.MAX)
        ours = torch.empty(numel, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(ours, data(4, p * numel, torch.bfloat16))
        exact = torch.stack([data(4, p * numel, torch.bfloat16, r) for r in range(p)]).double().sum(0)
        check(f"reduce_scatter bf16 n={numel}", ours, exact.chunk(p)[rank], tol=dict(rtol=2.0**-8, atol=1e-5))
        for root in (0, 3):
            ours, theirs = data(10, numel), data(10, numel)
            dist.reduce(ours, dst=root)
            dist.reduce(theirs, dst=root, group=gloo)
            check(f"reduce root={root} n={numel}", ours, theirs if rank == root else data(10, numel))

        for root in (0, 3):
            ours = data(5, numel)
            dist.broadcast(ours, src=root)
            check(f"broadcast root={root} n={numel}", ours, data(5, numel, who=root), exact=True)

        # The ops call the backend directly (NOTE [direct calls from the ops]): the multi-node path too.
        world, other = dist.group.WORLD.group_name, gloo.group_name
        for reduce_op in ("sum", "max", "avg"):
            x = data(11, p * numel)
            check(f"torch_tp::all_reduce {reduce_op} n={numel}", torch.ops.torch_tp.all_reduce(x, reduce_op, world),
                  torch.ops.torch_tp.all_reduce(x, reduce_op, other), exact=reduce_op == "max")
            check(f"torch_tp::reduce_scatter {reduce_op} n={numel}",
                  torch.ops.torch_tp.reduce_scatter(x, 0, reduce_op, world),
                  torch.ops.torch_tp.reduce_scatter(x, 0, reduce_op, other), exact=reduce_op == "max")
        inplace = data(12, numel)
        torch.ops.torch_tp.all_reduce_(inplace, "sum", world)
        check(f"torch_tp::all_reduce_ n={numel}", inplace, torch.ops.torch_tp.all_reduce(data(12, numel), "sum", other))
        check(f"torch_tp::all_gather n={numel}", torch.ops.torch_tp.all_gather(data(13, numel), 0, world, None),
              torch.ops.torch_tp.all_gather(data(13, numel), 0, other, None), exact=True)
        # Along a middle dim the ops hand the backend [outer, rows, inner] views (outer = 3 here).
        for reduce_op in ("sum", "avg"):
            x = data(14, 3 * p * numel * 2).view(3, p * numel, 2)
            check(f"torch_tp::reduce_scatter dim=1 {reduce_op} n={numel}",
                  torch.ops.torch_tp.reduce_scatter(x, 1, reduce_op, world),
                  torch.ops.torch_tp.reduce_scatter(x, 1, reduce_op, other))
        y = data(15, 3 * numel * 2).view(3, numel, 2)
        check(f"torch_tp::all_gather dim=1 n={numel}", torch.ops.torch_tp.all_gather(y, 1, world, None),
              torch.ops.torch_tp.all_gather(y, 1, other, None), exact=True)

        ours, theirs = torch.empty(p * numel), torch.empty(p * numel)
        dist.all_to_all_single(ours, data(6, p * numel))
        dist.all_to_all_single(theirs, data(6, p * numel), group=gloo)
        check(f"all_to_all_single n={numel}", ours, theirs, exact=True)

        # send/recv across the node boundary: 1 <-> 2, and within a node: 0 <-> 1
        for a, b in ((1, 2), (0, 1)):
            if rank in (a, b):
                peer = b if rank == a else a
                got = torch.empty(numel)
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, data(7, numel), peer),
                                                dist.P2POp(dist.irecv, got, peer)])
                for work in works:
                    work.wait()
                check(f"send/recv {a}<->{b} n={numel}", got, data(7, numel, who=peer), exact=True)
    # A message larger than a TCPStore value may be (8 MiB), across the nodes.
    if rank in (1, 2):
        peer, numel = 3 - rank, 3_000_000
        got = torch.empty(numel)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, data(9, numel), peer),
                                        dist.P2POp(dist.irecv, got, peer)])
        for work in works:
            work.wait()
        check("send/recv 1<->2 12 MB", got, data(9, numel, who=peer), exact=True)
    dist.barrier()

    # Sub-groups: one across the node boundary, one inside a node (all ranks create both).
    across, inside = dist.new_group([1, 2], backend="torch_tp"), dist.new_group([2, 3], backend="torch_tp")
    for group, members in ((across, [1, 2]), (inside, [2, 3])):
        if rank in members:
            ours = data(8, 40_000)
            dist.all_reduce(ours, group=group)
            reference = torch.stack([data(8, 40_000, who=r) for r in members]).double().sum(0)
            check(f"sub-group {members} all_reduce", ours, reference)
    dist.barrier()

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"failures": failures, "checks": checks}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
