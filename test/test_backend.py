"""The torch_tp process-group backend against gloo and an exact reference.

The rank pools here initialise their default group with ``backend="torch_tp"``
(``import torch_tp`` registers it) and a shared-memory buffer of
``SMALL_BUFFER`` bytes, so a tensor of a few hundred KiB already crosses the
buffer several times: every chunked path runs at test sizes. Each rank also
opens a gloo group over the same ranks and runs the same collective there, so
every result is compared with gloo's on the same inputs, and, since every rank
can rebuild every rank's input (deterministic per-rank seeds), with a
reduction computed in float64 (integers: int64) in one process.

Tolerances against the float64 reference, for a reduction over p ranks:
  float32   rtol 1e-6, atol 1e-6 * p: unit roundoff 2^-24 ~ 6e-8, p-1
            additions (plus one division for avg) of O(1) terms.
  bfloat16  rtol 2^-8, atol 1e-6 * p: the backend adds in float32 and rounds
            once to bfloat16 (unit roundoff 2^-8); the float32 additions add
            the atol.
  float16   rtol 2^-11, atol 1e-6 * p: the same with fp16's roundoff 2^-11.
  float64   rtol 1e-12; integers, bool, min, max, gathers: exact.
Against gloo: exact wherever no rounding happens (integers, min, max, gathers,
broadcasts); floats within the reference tolerance plus gloo's own error (gloo
adds bf16/fp16 in their own precision: 1.6e-2 / 2e-3 relative per rank, the
bounds test_collectives.py uses). Results are also checked to be bitwise
identical on every rank (the backend reduces in the same order everywhere).
"""

import hashlib
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import torch_tp  # noqa: F401  (registers the backend in this process too)
from torch_tp import ops

from _compare import mismatch
from reductions import C10D_OPS, REDUCE_OPS, reduce_reference

BACKEND = "torch_tp"
# Per-rank shared-memory buffer for the pools below: small, so tests cross it.
SMALL_BUFFER = 65536
ENV = {"TORCH_TP_SHM_BUFFER_BYTES": str(SMALL_BUFFER)}
WORLD_SIZES = [1, 2, 3, 4]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + [torch.bool]
# Element counts: empty, tiny, odd, one float32 buffer exactly, 2.4 and ~6 buffers.
NUMELS = [0, 1, 13, 1000, SMALL_BUFFER // 4, 40_000, 100_003]


def backend_pool(ranks, world_size):
    return ranks(world_size, BACKEND, ENV)


_GLOO = {}


def gloo_group():
    """A gloo group over the same ranks, created once per worker (all ranks call this in step)."""
    if "group" not in _GLOO:
        _GLOO["group"] = dist.new_group(backend="gloo")
    return _GLOO["group"]


def rank_input(rank, numel, dtype, reduce_op="sum", seed=0):
    """Rank ``rank``'s input of ``numel`` elements; any rank can rebuild any other's.

    Products use magnitudes in [0.5, 1.5] (floats) or {-2..2} (integers) so p
    factors stay representable; sums of 4 ranks stay inside int8 and uint8.
    """
    gen = torch.Generator().manual_seed(7919 * seed + 31 * numel + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    if dtype.is_floating_point:
        if reduce_op == "product":
            sign = torch.randint(0, 2, (numel,), generator=gen) * 2 - 1
            return ((torch.rand(numel, generator=gen, dtype=torch.float64) + 0.5) * sign).to(dtype)
        return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    low, high = (-2, 3) if reduce_op == "product" else (-30, 31)
    if dtype == torch.uint8:
        low, high = (0, 3) if reduce_op == "product" else (0, 60)
    return torch.randint(low, high, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def reference_tolerance(dtype, world_size):
    if dtype == torch.float32:
        return dict(rtol=1e-6, atol=1e-6 * world_size)
    if dtype == torch.bfloat16:
        return dict(rtol=2.0**-8, atol=1e-6 * world_size)
    if dtype == torch.float16:
        return dict(rtol=2.0**-11, atol=1e-6 * world_size)
    if dtype == torch.float64:
        return dict(rtol=1e-12, atol=1e-12)
    return dict(rtol=0, atol=0)


def gloo_tolerance(dtype, world_size):
    if dtype == torch.bfloat16:
        return dict(rtol=2.0**-8 + 1.6e-2, atol=1.6e-2 * world_size)
    if dtype == torch.float16:
        return dict(rtol=2.0**-11 + 2e-3, atol=2e-3 * world_size)
    return reference_tolerance(dtype, world_size)


def digest(tensor):
    """The bytes of ``tensor``: equal digests on every rank = bitwise identical results."""
    return hashlib.sha1(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------- all_reduce


def _check_all_reduce(dtype):
    rank, p = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == BACKEND
    failures, digests = [], {}
    for reduce_op in REDUCE_OPS:
        if reduce_op == "avg" and not dtype.is_floating_point:
            x = rank_input(rank, 4, dtype)
            with pytest.raises(RuntimeError):
                dist.all_reduce(x, op=dist.ReduceOp.AVG)  # as gloo: no integer average
            continue
        for numel in NUMELS:
            case = f"{reduce_op} n={numel}"
            x = rank_input(rank, numel, dtype, reduce_op)
            ours = x.clone()
            dist.all_reduce(ours, op=C10D_OPS[reduce_op])
            digests[case] = digest(ours)
            reference = reduce_reference(torch.stack([rank_input(r, numel, dtype, reduce_op) for r in range(p)]),
                                         reduce_op)
            exact = reduce_op in ("min", "max")
            tol = dict(rtol=0, atol=0) if exact else reference_tolerance(dtype, p)
            failures.append(mismatch(ours, reference, f"{case} vs reference", **tol))
            if dtype != torch.int16:  # gloo has no int16 kernels
                theirs = x.clone()
                dist.all_reduce(theirs, op=C10D_OPS[reduce_op], group=gloo_group())
                tol = dict(rtol=0, atol=0) if exact else gloo_tolerance(dtype, p)
                failures.append(mismatch(ours, theirs, f"{case} vs gloo", **tol))
    return [f for f in failures if f], digests


def _assert_results(results):
    failures = [f"rank {r}: {f}" for r, (fails, _) in enumerate(results) for f in fails]
    assert not failures, "\n".join(failures)
    digests = [d for _, d in results]
    for case in digests[0]:
        per_rank = [d[case] for d in digests]
        assert len(set(per_rank)) == 1, f"{case}: results differ bitwise across ranks"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce(ranks, world_size, dtype):
    _assert_results(backend_pool(ranks, world_size).run(_check_all_reduce, dtype))


def _check_all_reduce_default_buffer(numels):
    """The default buffer size (the pool above sets a small one) on sizes below and far above it."""
    rank, p = dist.get_rank(), dist.get_world_size()
    failures, digests = [], {}
    for numel in numels:
        x = rank_input(rank, numel, torch.float32)
        dist.all_reduce(x)
        digests[numel] = digest(x)
        reference = torch.stack([rank_input(r, numel, torch.float32) for r in range(p)]).double().sum(0)
        failures.append(mismatch(x, reference, f"n={numel}", **reference_tolerance(torch.float32, p)))
    return [f for f in failures if f], digests


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_default_buffer(ranks, world_size):
    numels = [1, 5000, 300_000, 3_000_001]  # up to 12 MB of float32
    _assert_results(ranks(world_size, BACKEND).run(_check_all_reduce_default_buffer, numels))


# ---------------------------------------------------------------- all_gather, reduce_scatter


def _check_all_gather(dtype):
    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    for numel in NUMELS:
        x = rank_input(rank, numel, dtype)
        expected = [rank_input(r, numel, dtype) for r in range(p)]
        as_list = [torch.full((numel,), 7).to(dtype) for _ in range(p)]
        dist.all_gather(as_list, x)
        for r in range(p):
            failures.append(mismatch(as_list[r], expected[r], f"list n={numel} from {r}", rtol=0, atol=0))
        into = torch.empty(p * numel, dtype=dtype)
        dist.all_gather_into_tensor(into, x)
        failures.append(mismatch(into, torch.cat(expected), f"into-tensor n={numel}", rtol=0, atol=0))
        # A 2-D output gathered along dim 0, as DTensor and FSDP use it.
        into_2d = torch.empty(p, numel, dtype=dtype)
        dist.all_gather_into_tensor(into_2d, x.view(1, numel))
        failures.append(mismatch(into_2d, torch.stack(expected), f"into 2-D n={numel}", rtol=0, atol=0))
    return [f for f in failures if f], {}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather(ranks, world_size, dtype):
    _assert_results(backend_pool(ranks, world_size).run(_check_all_gather, dtype))


def _check_reduce_scatter(dtype):
    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    ops_here = ["sum", "min", "max", "product"] + (["avg"] if dtype.is_floating_point else [])
    for reduce_op in ops_here:
        for numel in [0, 1, 13, 5000, 40_001]:  # per-rank piece; the input is p pieces
            case = f"{reduce_op} n={numel}"
            inputs = [rank_input(r, p * numel, dtype, reduce_op) for r in range(p)]
            reference = reduce_reference(torch.stack(inputs), reduce_op)[rank * numel:(rank + 1) * numel]
            exact = reduce_op in ("min", "max")
            tol = dict(rtol=0, atol=0) if exact else reference_tolerance(dtype, p)

            out = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter_tensor(out, inputs[rank], op=C10D_OPS[reduce_op])
            failures.append(mismatch(out, reference, f"tensor {case}", **tol))

            out_list = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter(out_list, list(inputs[rank].chunk(p)) if numel else
                                [torch.empty(0, dtype=dtype) for _ in range(p)], op=C10D_OPS[reduce_op])
            failures.append(mismatch(out_list, reference, f"list {case}", **tol))

            if dtype not in (torch.int16, torch.bool) and reduce_op != "avg":
                theirs = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_tensor(theirs, inputs[rank], op=C10D_OPS[reduce_op], group=gloo_group())
                tol = dict(rtol=0, atol=0) if exact else gloo_tolerance(dtype, p)
                failures.append(mismatch(out, theirs, f"{case} vs gloo", **tol))
    return [f for f in failures if f], {}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.int8, torch.int16, torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter(ranks, world_size, dtype):
    _assert_results(backend_pool(ranks, world_size).run(_check_reduce_scatter, dtype))


def _check_reduce_scatter_own_piece():
    """A rank folds its own piece straight from its input (shm_collectives.cpp,
    reads_own_piece_in_place): in place (output = its piece of the input, NCCL's
    in-place reduce-scatter), with the output overlapping the piece shifted by a few
    elements (which must take the copy through the slot: a direct read would read
    elements it has already written), and the ops' strided pieces of a dim-1
    reduce-scatter whose runs cross the slot's blocks. Each against the plain
    out-of-place reduce-scatter of the same values, bit for bit (the fold adds the
    ranks in the same order wherever the pieces are read from)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    numel = 3000  # 12000 bytes per piece: runs far over the direct read's 1 KiB minimum, several slot blocks
    inputs = [rank_input(r, p * numel, torch.float32) for r in range(p)]
    expected = torch.empty(numel)
    dist.reduce_scatter_tensor(expected, inputs[rank].clone())
    failures.append(mismatch(expected, reduce_reference(torch.stack(inputs), "sum")[rank * numel:(rank + 1) * numel],
                             "out of place", **reference_tolerance(torch.float32, p)))

    storage = torch.zeros(p * numel + 5)
    storage[:p * numel] = inputs[rank]
    in_place = storage[rank * numel:(rank + 1) * numel]
    dist.reduce_scatter_tensor(in_place, storage[:p * numel])
    failures.append(mismatch(in_place, expected, "in place", rtol=0, atol=0))

    storage = torch.zeros(p * numel + 5)
    storage[:p * numel] = inputs[rank]
    shifted = storage[rank * numel + 5:(rank + 1) * numel + 5]
    dist.reduce_scatter_tensor(shifted, storage[:p * numel])
    failures.append(mismatch(shifted, expected, "output overlapping the piece, shifted", rtol=0, atol=0))

    # [outer, p * c, inner] reduce-scattered along dim 1: rank r's piece is `outer` runs of c * inner.
    outer, c, inner = 3, 10, 100
    xs = [rank_input(r, outer * p * c * inner, torch.float32, seed=1).view(outer, p * c, inner) for r in range(p)]
    piece = torch.ops.torch_tp.reduce_scatter(xs[rank], 1, "sum", dist.group.WORLD.group_name)
    flat = torch.empty(outer * c * inner)
    dist.reduce_scatter_tensor(flat, torch.cat([x.chunk(p, dim=1)[r].reshape(-1) for r in range(p)
                                                for x in xs[rank:rank + 1]]))
    failures.append(mismatch(piece, flat.view(outer, c, inner), "dim-1 pieces", rtol=0, atol=0))
    return [f for f in failures if f], {}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_reads_own_piece(ranks, world_size):
    _assert_results(backend_pool(ranks, world_size).run(_check_reduce_scatter_own_piece))


# ---------------------------------------------------------------- rooted collectives


def _check_rooted(dtype):
    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    exact = dict(rtol=0, atol=0)
    for root in range(p):
        for numel in [0, 1, 1000, 40_000]:
            case = f"root={root} n={numel}"
            # broadcast
            x = rank_input(rank, numel, dtype, seed=1)
            dist.broadcast(x, src=root)
            failures.append(mismatch(x, rank_input(root, numel, dtype, seed=1), f"broadcast {case}", **exact))
            # reduce: only the root's result is defined (gloo uses the others' tensors as scratch)
            x = rank_input(rank, numel, dtype, seed=2)
            dist.reduce(x, dst=root, op=dist.ReduceOp.MAX)
            if rank == root:
                reference = reduce_reference(torch.stack([rank_input(r, numel, dtype, seed=2) for r in range(p)]),
                                             "max")
                failures.append(mismatch(x, reference, f"reduce max {case}", **exact))
            # gather
            x = rank_input(rank, numel, dtype, seed=3)
            gathered = [torch.empty(numel, dtype=dtype) for _ in range(p)] if rank == root else None
            dist.gather(x, gathered, dst=root)
            if rank == root:
                for r in range(p):
                    failures.append(mismatch(gathered[r], rank_input(r, numel, dtype, seed=3),
                                             f"gather {case} from {r}", **exact))
            # scatter: the root's piece r goes to rank r
            pieces = [rank_input(100 + r, numel, dtype, seed=4) for r in range(p)]
            out = torch.empty(numel, dtype=dtype)
            dist.scatter(out, pieces if rank == root else None, src=root)
            failures.append(mismatch(out, pieces[rank], f"scatter {case}", **exact))
    if dtype.is_floating_point:  # a reduce that rounds: the sum, against the float64 reference
        for root in range(p):
            x = rank_input(rank, 30_000, dtype, seed=5)
            dist.reduce(x, dst=root, op=dist.ReduceOp.SUM)
            if rank == root:
                stacked = torch.stack([rank_input(r, 30_000, dtype, seed=5) for r in range(p)])
                failures.append(mismatch(x, reduce_reference(stacked, "sum"),
                                         f"reduce sum root={root}", **reference_tolerance(dtype, p)))
    return [f for f in failures if f], {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rooted_collectives(ranks, world_size, dtype):
    _assert_results(backend_pool(ranks, world_size).run(_check_rooted, dtype))


# ---------------------------------------------------------------- all_to_all


def _split(sender, receiver, scale):
    """Elements ``sender`` sends ``receiver`` (uneven, some zero; a rank's piece to itself the largest, which it
    copies without the shared buffer, so that the peers' pieces alone set the steps)."""
    return ((sender * 7 + receiver * 3) % 5 + 6 * (sender == receiver)) * scale


def _check_all_to_all(dtype, scale):
    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    exact = dict(rtol=0, atol=0)

    def sent(sender):
        return rank_input(sender, sum(_split(sender, r, scale) for r in range(p)), dtype, seed=6)

    def piece(sender, receiver):
        start = sum(_split(sender, r, scale) for r in range(receiver))
        return sent(sender)[start:start + _split(sender, receiver, scale)]

    # single tensor, even splits
    even = rank_input(rank, p * 3 * scale, dtype, seed=7)
    out = torch.empty_like(even)
    dist.all_to_all_single(out, even)
    expected = torch.cat([rank_input(r, p * 3 * scale, dtype, seed=7).chunk(p)[rank] for r in range(p)])
    failures.append(mismatch(out, expected, "all_to_all_single even", **exact))

    # single tensor, uneven splits
    in_splits = [_split(rank, r, scale) for r in range(p)]
    out_splits = [_split(r, rank, scale) for r in range(p)]
    out = torch.empty(sum(out_splits), dtype=dtype)
    dist.all_to_all_single(out, sent(rank), output_split_sizes=out_splits, input_split_sizes=in_splits)
    expected = torch.cat([piece(r, rank) for r in range(p)])
    failures.append(mismatch(out, expected, "all_to_all_single uneven", **exact))

    # list form, uneven
    outs = [torch.empty(_split(r, rank, scale), dtype=dtype) for r in range(p)]
    dist.all_to_all(outs, [piece(rank, r) for r in range(p)])
    for r in range(p):
        failures.append(mismatch(outs[r], piece(r, rank), f"all_to_all list from {r}", **exact))
    return [f for f in failures if f], {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all(ranks, world_size, dtype):
    # scale 1: a few elements; scale 20_000: pieces up to 80_000 elements, several buffers
    for scale in (1, 20_000):
        _assert_results(backend_pool(ranks, world_size).run(_check_all_to_all, dtype, scale))


# ---------------------------------------------------------------- point to point, barrier


def _check_send_recv(numel):
    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    exact = dict(rtol=0, atol=0)
    right, left = (rank + 1) % p, (rank - 1) % p
    # Every rank sends to its right and receives from its left at the same time:
    # the backend must not make a send wait for the receiver's collective queue.
    mine = rank_input(rank, numel, torch.float32, seed=8)
    got = torch.empty(numel)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.irecv, got, left)])
    for work in works:
        work.wait()
    failures.append(mismatch(got, rank_input(left, numel, torch.float32, seed=8), f"ring n={numel}", **exact))
    # isend both ways first, then the receives (gloo's send does not wait for the receive).
    sends = [dist.isend(rank_input(rank, numel, torch.float32, seed=9 + k), right) for k in range(2)]
    for k in range(2):
        got = torch.empty(numel)
        dist.recv(got, src=left)
        failures.append(mismatch(got, rank_input(left, numel, torch.float32, seed=9 + k),
                                 f"message {k} n={numel} (order kept)", **exact))
    for work in sends:
        work.wait()
    # Blocking send/recv in an order that matches up.
    if p > 1:
        if rank == 0:
            dist.send(mine, dst=p - 1)
        elif rank == p - 1:
            got = torch.empty(numel)
            dist.recv(got, src=0)
            failures.append(mismatch(got, rank_input(0, numel, torch.float32, seed=8), "blocking 0 -> p-1", **exact))
    return [f for f in failures if f], {}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_send_recv(ranks, world_size):
    for numel in (0, 10, 100_003):  # 100_003 floats: ~6 buffers
        _assert_results(backend_pool(ranks, world_size).run(_check_send_recv, numel))


def _check_send_recv_all_pairs(numel):
    """Every rank sends a message of ``numel`` to every other rank with blocking
    sends, then receives from all: each message is many rings long, and only
    buffered sends let the ranks get past their sends."""
    rank, p = dist.get_rank(), dist.get_world_size()
    exact = dict(rtol=0, atol=0)
    failures = []
    for dst in range(p):
        if dst != rank:
            dist.send(rank_input(rank * p + dst, numel, torch.float32, seed=30), dst=dst, tag=dst)
    for src in range(p):
        if src != rank:
            got = torch.empty(numel)
            dist.recv(got, src=src, tag=rank)
            failures.append(mismatch(got, rank_input(src * p + rank, numel, torch.float32, seed=30),
                                     f"{src} -> {rank} n={numel}", **exact))
    return [f for f in failures if f], {}


@pytest.mark.parametrize("world_size", [2, 4])
def test_send_recv_large_both_ways(ranks, world_size):
    # 1_000_003 floats: ~60 rings of the 64 KiB buffer at 2 ranks, ~180 at 4.
    for numel in (100_003, 1_000_003):
        _assert_results(backend_pool(ranks, world_size).run(_check_send_recv_all_pairs, numel))


def _check_many_small_messages(count):
    """``count`` small messages to the right, of varying size and dtype, sent
    before any is received: they arrive in order with their own contents."""
    rank, p = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % p, (rank - 1) % p
    dtypes = [torch.float32, torch.int64, torch.bfloat16, torch.uint8]

    def message(sender, k):
        return rank_input(sender, k % 37, dtypes[k % len(dtypes)], seed=1000 + k)

    sends = [dist.isend(message(rank, k), right, tag=k % 5) for k in range(count)]
    failures = []
    for k in range(count):
        expected = message(left, k)
        got = torch.empty_like(expected)
        dist.recv(got, src=left, tag=k % 5)
        failures.append(mismatch(got, expected, f"message {k}", rtol=0, atol=0))
    for work in sends:
        work.wait()
    return [f for f in failures if f], {}


@pytest.mark.parametrize("world_size", [2, 3])
def test_many_small_messages_in_order(ranks, world_size):
    _assert_results(backend_pool(ranks, world_size).run(_check_many_small_messages, 500))


def _check_send_recv_mismatch():
    """A recv that does not match the send is an error; the pair stays usable."""
    rank = dist.get_rank()
    failures = []
    cases = [(torch.ones(10), torch.empty(12), 0, 0, "numel"),
             (torch.ones(100_000), torch.empty(100_000, dtype=torch.float64), 0, 0, "dtype"),
             (torch.ones(10), torch.empty(10), 1, 2, "tag")]
    for sent, got, send_tag, recv_tag, what in cases:
        if rank == 0:
            dist.send(sent, dst=1, tag=send_tag)
        else:
            try:
                dist.recv(got, src=0, tag=recv_tag)
                failures.append(f"{what}: a mismatched recv went through")
            except RuntimeError as e:
                if "recv: mismatch" not in str(e):
                    failures.append(f"{what}: unclear error: {e}")
    # The next message still arrives intact.
    x = rank_input(0, 70_001, torch.float32, seed=31)
    if rank == 0:
        dist.send(x, dst=1)
    else:
        got = torch.empty_like(x)
        dist.recv(got, src=0)
        failures.append(mismatch(got, x, "after the mismatches", rtol=0, atol=0))
    return [f for f in failures if f], {}


def test_send_recv_mismatch_is_an_error(ranks):
    _assert_results(backend_pool(ranks, 2).run(_check_send_recv_mismatch))


def _check_barrier(delay):
    if dist.get_rank() == 0:
        time.sleep(delay)
    start = time.monotonic()
    dist.barrier()
    return time.monotonic() - start


@pytest.mark.parametrize("world_size", [2, 4])
def test_barrier_waits_for_everyone(ranks, world_size):
    delay = 0.5
    waited = backend_pool(ranks, world_size).run(_check_barrier, delay)
    # Rank 0 sleeps before it arrives, so every other rank waits nearly that long.
    assert all(w > delay * 0.8 for w in waited[1:]), waited


# ---------------------------------------------------------------- async, coalesced, groups


def _check_async():
    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    numels = [10, 50_000, 3, 200_000]
    xs = [rank_input(rank, n, torch.float32, seed=10) for n in numels]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    gathered = torch.empty(p * 1000)
    gather_work = dist.all_gather_into_tensor(gathered, rank_input(rank, 1000, torch.float32, seed=11),
                                              async_op=True)
    futures = [w.get_future() for w in works]
    # Wait out of order; futures hand back the output tensors.
    gather_work.wait()
    for n, x, work, future in reversed(list(zip(numels, xs, works, futures))):
        work.wait()
        assert work.is_completed()
        assert torch.equal(future.wait()[0], x), "the future's value is not the reduced tensor"
        reference = torch.stack([rank_input(r, n, torch.float32, seed=10) for r in range(p)]).double().sum(0)
        failures.append(mismatch(x, reference, f"async n={n}", **reference_tolerance(torch.float32, p)))
    failures.append(mismatch(gathered, torch.cat([rank_input(r, 1000, torch.float32, seed=11) for r in range(p)]),
                             "async all_gather", rtol=0, atol=0))
    # A continuation chained on the future runs once the collective is done.
    y = torch.ones(5)
    chained = dist.all_reduce(y, async_op=True).get_future().then(lambda fut: fut.value()[0] * 2)
    failures.append(mismatch(chained.wait(), torch.full((5,), 2.0 * p), "future.then", rtol=0, atol=0))
    # Once wait() returns, the future is done too: torch's DDP join() reads
    # work.get_future().value() right after work.wait(). (The Work used to be
    # finished before its future, and this failed now and then.)
    for i in range(300):
        work = dist.all_reduce(torch.ones(4), async_op=True)
        work.wait()
        assert work.get_future().done(), f"round {i}: wait() returned before the future completed"
    return [f for f in failures if f], {}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_async(ranks, world_size):
    _assert_results(backend_pool(ranks, world_size).run(_check_async))


def _check_coalesced():
    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    exact = dict(rtol=0, atol=0)
    numels = [7, 30_000, 0, 1]
    # all_reduce, coalesced by the coalescing manager (one allreduce_coalesced call)
    xs = [rank_input(rank, n, torch.float32, seed=12) for n in numels]
    with dist._coalescing_manager(async_ops=True) as cm:
        for x in xs:
            dist.all_reduce(x)
    cm.wait()
    for n, x in zip(numels, xs):
        reference = torch.stack([rank_input(r, n, torch.float32, seed=12) for r in range(p)]).double().sum(0)
        failures.append(mismatch(x, reference, f"coalesced all_reduce n={n}", **reference_tolerance(torch.float32, p)))
    # all_gather_into_tensor and reduce_scatter_tensor, coalesced
    outs = [torch.empty(p * n) for n in numels]
    with dist._coalescing_manager():
        for n, out in zip(numels, outs):
            dist.all_gather_into_tensor(out, rank_input(rank, n, torch.float32, seed=13))
    for n, out in zip(numels, outs):
        expected = torch.cat([rank_input(r, n, torch.float32, seed=13) for r in range(p)])
        failures.append(mismatch(out, expected, f"coalesced all_gather n={n}", **exact))
    outs = [torch.empty(n) for n in numels]
    with dist._coalescing_manager():
        for n, out in zip(numels, outs):
            dist.reduce_scatter_tensor(out, rank_input(rank, p * n, torch.float32, seed=14), op=dist.ReduceOp.MAX)
    for n, out in zip(numels, outs):
        stacked = torch.stack([rank_input(r, p * n, torch.float32, seed=14) for r in range(p)])
        failures.append(mismatch(out, stacked.amax(0)[rank * n:(rank + 1) * n],
                                 f"coalesced reduce_scatter n={n}", **exact))
    # the functional collectives torch.compile, DTensor and FSDP2 emit
    group_name = dist.group.WORLD.group_name
    functional = torch.ops._c10d_functional
    ys = [rank_input(rank, n, torch.float32, seed=15) for n in numels]
    reduced = [functional.wait_tensor(t) for t in functional.all_reduce_coalesced(ys, "sum", group_name)]
    for n, y in zip(numels, reduced):
        reference = torch.stack([rank_input(r, n, torch.float32, seed=15) for r in range(p)]).double().sum(0)
        failures.append(mismatch(y, reference, f"functional all_reduce n={n}", **reference_tolerance(torch.float32, p)))
    gathered = [functional.wait_tensor(t)
                for t in functional.all_gather_into_tensor_coalesced(ys, p, group_name)]
    for n, g in zip(numels, gathered):
        expected = torch.cat([rank_input(r, n, torch.float32, seed=15) for r in range(p)])
        failures.append(mismatch(g, expected, f"functional all_gather n={n}", **exact))
    big = [rank_input(rank, p * n, torch.float32, seed=16) for n in numels]
    scattered = [functional.wait_tensor(t)
                 for t in functional.reduce_scatter_tensor_coalesced(big, "sum", p, group_name)]
    for n, s in zip(numels, scattered):
        stacked = torch.stack([rank_input(r, p * n, torch.float32, seed=16) for r in range(p)])
        reference = stacked.double().sum(0)[rank * n:(rank + 1) * n]
        failures.append(mismatch(s, reference, f"functional reduce_scatter n={n}",
                                 **reference_tolerance(torch.float32, p)))
    return [f for f in failures if f], {}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_coalesced(ranks, world_size):
    _assert_results(backend_pool(ranks, world_size).run(_check_coalesced))


def _check_several_groups():
    """Sub-groups and a second full group alive at once, with async ops interleaved across them."""
    rank = dist.get_rank()
    failures = []
    pairs = [dist.new_group([0, 1], backend=BACKEND), dist.new_group([2, 3], backend=BACKEND)]
    mine = pairs[rank // 2]
    everyone = dist.new_group(backend=BACKEND)
    odd_ones = dist.new_group([1, 3], backend=BACKEND)
    assert dist.get_backend(mine) == BACKEND
    x_pair = rank_input(rank, 50_000, torch.float32, seed=17)
    x_all = rank_input(rank, 50_000, torch.float32, seed=18)
    w_pair = dist.all_reduce(x_pair, group=mine, async_op=True)
    w_all = dist.all_reduce(x_all, group=everyone, async_op=True)
    if rank % 2 == 1:
        x_odd = torch.full((3,), float(rank))
        dist.all_reduce(x_odd, group=odd_ones)
        failures.append(mismatch(x_odd, torch.full((3,), 4.0), "group [1, 3]", rtol=0, atol=0))
    w_all.wait()
    w_pair.wait()
    partners = [2 * (rank // 2), 2 * (rank // 2) + 1]
    pair_ref = torch.stack([rank_input(r, 50_000, torch.float32, seed=17) for r in partners]).double().sum(0)
    all_ref = torch.stack([rank_input(r, 50_000, torch.float32, seed=18) for r in range(4)]).double().sum(0)
    failures.append(mismatch(x_pair, pair_ref, "pair group", **reference_tolerance(torch.float32, 2)))
    failures.append(mismatch(x_all, all_ref, "second full group", **reference_tolerance(torch.float32, 4)))
    # A 2x2 DeviceMesh: its dimension groups use the default backend.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        assert dist.get_backend(group) == BACKEND, dist.get_backend(group)
        members = dist.get_process_group_ranks(group)
        y = torch.full((1000,), float(rank + 1))
        dist.all_reduce(y, group=group)
        failures.append(mismatch(y, torch.full((1000,), float(sum(m + 1 for m in members))),
                                 f"mesh dim {dim}", rtol=0, atol=0))
    for group in pairs + [everyone, odd_ones]:
        dist.destroy_process_group(group)
    return [f for f in failures if f], {}


def test_several_groups(ranks):
    _assert_results(backend_pool(ranks, 4).run(_check_several_groups))


# ---------------------------------------------------------------- the torch_tp ops on this backend


def _check_torch_tp_ops():
    """The foundation ops give the same values on this backend as on gloo."""
    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    gloo = gloo_group()
    tol = reference_tolerance(torch.float32, p)
    x = rank_input(rank, 6 * p * 5, torch.float32, seed=19).view(6 * p, 5)
    for name, fn in [
        ("all_reduce", lambda g: ops.all_reduce(x, "sum", group=g)),
        ("all_gather", lambda g: ops.all_gather(x, 1, group=g)),
        ("reduce_scatter", lambda g: ops.reduce_scatter(x, 0, "max", group=g)),
    ]:
        failures.append(mismatch(fn(dist.group.WORLD), fn(gloo), name, **tol))
    # A column- then row-parallel MLP, forward and backward.
    gen = torch.Generator().manual_seed(20)
    w1 = torch.randn(8 * p, 6, generator=gen)
    w2 = torch.randn(6, 8 * p, generator=gen)
    inp = torch.randn(4, 6, generator=gen)
    results = {}
    for label, group in [("torch_tp", dist.group.WORLD), ("gloo", gloo)]:
        a = ops.shard(w1, 0, group=group).clone().requires_grad_()
        b = ops.shard(w2, 1, group=group).clone().requires_grad_()
        h = torch.ops.torch_tp.column_parallel_linear(inp, a, None, group.group_name, None, None, "gelu_tanh", False)
        out = torch.ops.torch_tp.row_parallel_linear(h, b, None, group.group_name, None)
        out.square().sum().backward()
        results[label] = (out.detach(), a.grad, b.grad)
    # The MLP's values are sums of 6 to 8p products whose size grows with the
    # loss: float32 roundoff relative to the largest element of each tensor.
    for name, ours, theirs in zip(["output", "grad w1", "grad w2"], results["torch_tp"], results["gloo"]):
        scale = theirs.abs().max().item()
        failures.append(mismatch(ours, theirs, f"mlp {name}", rtol=1e-5, atol=1e-5 * scale))
    return [f for f in failures if f], {}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_torch_tp_ops_on_backend(ranks, world_size):
    _assert_results(backend_pool(ranks, world_size).run(_check_torch_tp_ops))


def _collectives_called(call):
    """The collectives that ``call()`` ran, from torch's profiler: c10d's ops and the backend's direct calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    return {e.name for e in prof.events() if e.name.startswith(("c10d::", "torch_tp_backend::"))}


def _check_ops_call_the_backend_directly():
    """The ops' synchronous collectives skip c10d on this backend and equal the c10d calls bitwise."""
    rank, p = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    name = group.group_name
    failures, digests = [], {}
    # Sizes: one-shot, and several chunks of the SMALL_BUFFER slots (the
    # separate output of the chunked path); dim 0 divides by p for reduce_scatter.
    for dtype in [torch.float32, torch.bfloat16, torch.int32]:
        for rows in [3, 20_000]:
            for reduce_op in REDUCE_OPS:
                if reduce_op == "avg" and not dtype.is_floating_point:
                    continue
                x = rank_input(rank, rows * p * 2, dtype, reduce_op, seed=23).view(rows * p, 2)
                case = f"{dtype} rows={rows * p} {reduce_op}"
                ours = torch.ops.torch_tp.all_reduce(x, reduce_op, name)
                # c10d's path: avg is a sum and a division there too (NOTE [direct calls from the ops]).
                theirs = x.clone()
                dist.all_reduce(theirs, op=C10D_OPS["sum" if reduce_op == "avg" else reduce_op])
                if reduce_op == "avg":
                    theirs.div_(p)
                failures.append(mismatch(ours, theirs, f"all_reduce {case}", rtol=0, atol=0))
                digests[f"all_reduce {case}"] = digest(ours)
                ours = torch.ops.torch_tp.reduce_scatter(x, 0, reduce_op, name)
                theirs = torch.empty(rows, 2, dtype=dtype)
                dist.reduce_scatter_tensor(theirs, x, op=C10D_OPS["sum" if reduce_op == "avg" else reduce_op])
                if reduce_op == "avg":
                    theirs.div_(p)
                failures.append(mismatch(ours, theirs, f"reduce_scatter {case}", rtol=0, atol=0))
            x = rank_input(rank, rows * 2, dtype, seed=24).view(rows, 2)
            theirs = torch.empty(rows * p, 2, dtype=dtype)
            dist.all_gather_into_tensor(theirs, x)
            failures.append(mismatch(torch.ops.torch_tp.all_gather(x, 0, name, None), theirs,
                                     f"all_gather {dtype} rows={rows}", rtol=0, atol=0))
    # The ops call the backend directly, no c10d op (which dist.all_reduce shows).
    x = torch.ones(16, 4)
    assert _collectives_called(lambda: dist.all_reduce(x.clone())) == {"c10d::allreduce_"}
    for call, direct in [
        (lambda: torch.ops.torch_tp.all_reduce(x, "sum", name), "all_reduce"),
        (lambda: torch.ops.torch_tp.all_reduce_(x.clone(), "sum", name), "all_reduce"),
        (lambda: torch.ops.torch_tp.all_gather(x, 0, name, None), "all_gather_into_tensor"),
        (lambda: torch.ops.torch_tp.reduce_scatter(x, 0, "sum", name), "reduce_scatter_tensor"),
    ]:
        called = _collectives_called(call)
        want = {f"torch_tp_backend::{direct}"} if p > 1 else set()  # one rank: no collective at all
        if called != want:
            failures.append(f"{direct}: the profiler shows {sorted(called)}, want {sorted(want)}")
    # The column linear's backward starts its gather and reduce-scatter to overlap them with GEMMs. Where the
    # node's CPUs leave no core for each rank's worker thread, the op makes those calls directly instead
    # (NOTE [async calls without a core to run on]); otherwise they are c10d's async calls.
    xs = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(29), requires_grad=True)
    out = torch.ops.torch_tp.column_parallel_linear(xs, w, None, name, 0, None)
    called = _collectives_called(lambda: out.backward(torch.ones_like(out)))
    if p == 1:
        want = set()
    elif 2 * p > os.sysconf("SC_NPROCESSORS_ONLN"):
        want = {"torch_tp_backend::all_gather_into_tensor", "torch_tp_backend::reduce_scatter_tensor"}
    else:
        want = {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_"}
    if called != want:
        failures.append(f"column_parallel_linear backward: the profiler shows {sorted(called)}, want {sorted(want)}")
    # A direct call behind queued async calls waits its turn: results in issue order.
    big = [rank_input(rank, 100_000, torch.float32, seed=25 + k) for k in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in big]
    small = rank_input(rank, 7, torch.float32, seed=28)
    ours = torch.ops.torch_tp.all_reduce(small, "sum", name)
    for work in works:
        work.wait()
    reference = torch.stack([rank_input(r, 7, torch.float32, seed=28) for r in range(p)]).double().sum(0)
    failures.append(mismatch(ours, reference, "direct call after async ones", **reference_tolerance(torch.float32, p)))
    for k, t in enumerate(big):
        reference = torch.stack([rank_input(r, 100_000, torch.float32, seed=25 + k) for r in range(p)]).double().sum(0)
        failures.append(mismatch(t, reference, f"async call {k} before a direct one",
                                 **reference_tolerance(torch.float32, p)))
    return [f for f in failures if f], digests


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ops_call_the_backend_directly(ranks, world_size):
    _assert_results(backend_pool(ranks, world_size).run(_check_ops_call_the_backend_directly))


# ---------------------------------------------------------------- errors


def _check_bad_input():
    cases = [
        # (complex tensors are fine: torch hands the backend their view_as_real)
        (["all_reduce"], lambda: dist.all_reduce(torch.ones(3, dtype=torch.uint32))),
        (["all_gather"], lambda: dist.all_gather([torch.empty(3)], torch.ones(3))),  # a list of 1 for 2 ranks
        # The bitwise reductions gloo has are not folded here; the error names them.
        (["all_reduce", "reduce_op BAND"],
         lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.BAND)),
        (["reduce_scatter", "reduce_op BXOR"],
         lambda: dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.int64), torch.ones(4, dtype=torch.int64),
                                            op=dist.ReduceOp.BXOR)),
    ]
    messages = []
    for fragments, call in cases:
        try:
            call()
        except (RuntimeError, ValueError) as e:
            messages.append((fragments, str(e)))
        else:
            messages.append((fragments, None))
    return messages


def test_bad_input_is_refused_clearly(ranks):
    for messages in backend_pool(ranks, 2).run(_check_bad_input):
        for fragments, message in messages:
            assert message is not None, f"{fragments}: bad input accepted"
            assert "torch_tp" in message and all(f in message for f in fragments), message


def _check_non_contiguous():
    rank, p = dist.get_rank(), dist.get_world_size()
    base = rank_input(rank, 12, torch.float32, seed=21).view(3, 4)
    x = base.t()
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        return [] if "contiguous" in str(e) else [f"unclear error: {e}"], {}
    reference = torch.stack([rank_input(r, 12, torch.float32, seed=21).view(3, 4).t() for r in range(p)])
    return [f for f in [mismatch(x, reference.double().sum(0), "t()",
                                 **reference_tolerance(torch.float32, p))] if f], {}


def test_non_contiguous(ranks):
    _assert_results(backend_pool(ranks, 2).run(_check_non_contiguous))


def _check_backend_name():
    return dist.get_backend(), dist.get_backend(dist.group.WORLD)


def test_backend_name(ranks):
    assert backend_pool(ranks, 2).run(_check_backend_name) == [(BACKEND, BACKEND)] * 2


# ---------------------------------------------------------------- NaN under min/max, all_gather_into_tensor's shape


def _check_nan_under_min_max():
    """NaN under max/min does not depend on which rank holds it:
    the backend's fold follows torch.maximum/minimum, as torch.amax does."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    nan = float("nan")
    inputs = [torch.tensor([nan, 1, 2, 5]), torch.tensor([3, nan, 4, 0])] + \
        [torch.tensor([1.0, 2, 3, 4])] * (world_size - 2)
    stacked = torch.stack(inputs)
    for dtype in FLOAT_DTYPES:
        for reduce_op, reference in (("max", stacked.amax(0)), ("min", stacked.amin(0))):
            x = inputs[rank].to(dtype, copy=True)
            dist.all_reduce(x, op=C10D_OPS[reduce_op])
            torch.testing.assert_close(x, reference.to(dtype), equal_nan=True, atol=0, rtol=0)
            ours = ops.all_reduce(inputs[rank].to(dtype), reduce_op)
            torch.testing.assert_close(ours, reference.to(dtype), equal_nan=True, atol=0, rtol=0)
            # reduce_scatter of [p * 4]: each rank's piece of the same reduction.
            full = torch.cat([inputs[rank]] * world_size).to(dtype)
            piece = torch.empty(4, dtype=dtype)
            dist.reduce_scatter_tensor(piece, full, op=C10D_OPS[reduce_op])
            torch.testing.assert_close(piece, reference.to(dtype), equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_nan_under_min_max(ranks, world_size):
    backend_pool(ranks, world_size).run(_check_nan_under_min_max)


def _check_all_gather_into_tensor_shape():
    """An output of the right element count but another shape is refused, as
    gloo refuses it (it used to be filled in the concatenated layout)."""
    world_size = dist.get_world_size()
    x = torch.ones(2, 3)
    ok = torch.empty(2 * world_size, 3)
    dist.all_gather_into_tensor(ok, x)
    assert torch.equal(ok, torch.ones(2 * world_size, 3))
    for shape in [(world_size, 2, 3), (3, 2 * world_size), (6 * world_size,)]:
        with pytest.raises(RuntimeError, match=r"all_gather_into_tensor: output has shape"):
            dist.all_gather_into_tensor(torch.empty(shape), x)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_all_gather_into_tensor_checks_the_shape(ranks, world_size):
    backend_pool(ranks, world_size).run(_check_all_gather_into_tensor_shape)
