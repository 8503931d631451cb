"""The torch_tp collective ops against torch.distributed and an unsharded reference.

Each check runs on every rank of a gloo pool (see multirank.py). Every rank can
rebuild every rank's input (deterministic per-rank seeds), so besides matching
torch.distributed's own collective on the same group bitwise, each result is
also checked against the reduction computed in float64 in one process.

Tolerances against the float64 reference, for a sum of p O(1) terms:
  float32   rtol 1e-6, atol 1e-6 * p: unit roundoff 2^-24 ~ 6e-8, p-1 roundings.
  bfloat16  rtol 1.6e-2, atol 1.6e-2 * p: gloo adds in bf16 (roundoff 2^-8 ~
            3.9e-3), p-1 additions plus the final rounding, ~2 ulp each.
  float16   rtol 2e-3, atol 2e-3 * p: roundoff 2^-11 ~ 4.9e-4, same count.
  float64, integers, min, max: exact up to float64 roundoff (1e-12).
Against torch.distributed on the same group the results are bitwise equal.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import torch_tp
from torch_tp import ops

from _compare import assert_error_names, assert_message_names
from reductions import C10D_OPS, REDUCE_OPS, reduce_reference

WORLD_SIZES = [1, 2, 4]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# gloo has no int16 kernels ("Invalid scalar type"); the ops pass that on with
# their own context (see _check_backend_dtype_error).
INT_DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64]


def _tolerance(dtype, world_size):
    if dtype == torch.float32:
        return dict(rtol=1e-6, atol=1e-6 * world_size)
    if dtype == torch.bfloat16:
        return dict(rtol=1.6e-2, atol=1.6e-2 * world_size)
    if dtype == torch.float16:
        return dict(rtol=2e-3, atol=2e-3 * world_size)
    return dict(rtol=1e-12, atol=1e-12)


def _rank_input(rank, shape, dtype, reduce_op="sum", seed=0, contiguous=True):
    """Rank ``rank``'s input; any rank can rebuild any other's.

    Products use magnitudes in [0.5, 1.5] (floats) or {-2..2} (integers) so
    that p factors stay representable; unsigned types get non-negative values.
    Non-contiguous inputs are transposed views of a buffer of the reversed shape.
    """
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    full_shape = tuple(reversed(shape)) if not contiguous else tuple(shape)
    if dtype.is_floating_point:
        if reduce_op == "product":
            sign = torch.randint(0, 2, full_shape, generator=gen) * 2 - 1
            x = (torch.rand(full_shape, generator=gen, dtype=torch.float64) + 0.5) * sign
        else:
            x = torch.randn(full_shape, generator=gen, dtype=torch.float64)
    else:
        # Sums of 4 ranks stay inside int8 and uint8.
        low, high = (-2, 3) if reduce_op == "product" else (-30, 31)
        if dtype == torch.uint8:
            low, high = (0, 3) if reduce_op == "product" else (0, 60)
        x = torch.randint(low, high, full_shape, generator=gen, dtype=torch.int64)
    x = x.to(dtype)
    if not contiguous:
        x = x.permute(*reversed(range(x.dim())))
        assert tuple(x.shape) == tuple(shape) and not x.is_contiguous()
    return x


def _all_inputs(world_size, *args, **kwargs):
    return torch.stack([_rank_input(r, *args, **kwargs) for r in range(world_size)])


# ---------------------------------------------------------------- values


def _check_all_reduce(shape, dtype, reduce_op, contiguous):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = _rank_input(rank, shape, dtype, reduce_op, contiguous=contiguous)
    ours = ops.all_reduce(x, reduce_op)
    assert ours.is_contiguous() and ours.dtype == dtype and ours.shape == x.shape

    expected = x.contiguous().clone()
    dist.all_reduce(expected, op=C10D_OPS[reduce_op])
    assert torch.equal(ours, expected), "differs from dist.all_reduce on the same group"

    reference = reduce_reference(_all_inputs(world_size, shape, dtype, reduce_op, contiguous=contiguous), reduce_op)
    torch.testing.assert_close(ours.to(reference.dtype), reference, **_tolerance(dtype, world_size))
    assert torch.equal(x, _rank_input(rank, shape, dtype, reduce_op, contiguous=contiguous)), "input was modified"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_float(ranks, world_size):
    pool = ranks(world_size)
    for dtype in FLOAT_DTYPES:
        for reduce_op in REDUCE_OPS:
            pool.run(_check_all_reduce, (5, 7), dtype, reduce_op, True)
    pool.run(_check_all_reduce, (3, 4, 6), torch.float32, "sum", False)
    pool.run(_check_all_reduce, (0, 3), torch.float32, "sum", True)
    pool.run(_check_all_reduce, (), torch.float64, "max", True)


def _check_all_reduce_inplace():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    for dtype, reduce_op, contiguous in [(torch.float32, "sum", True), (torch.bfloat16, "avg", True),
                                         (torch.int64, "product", True), (torch.float64, "max", False)]:
        x = _rank_input(rank, (5, 7), dtype, reduce_op, contiguous=contiguous)
        expected = ops.all_reduce(x, reduce_op)
        storage = x.data_ptr()
        assert ops.all_reduce_(x, reduce_op) is x
        assert x.data_ptr() == storage and x.is_contiguous() == contiguous, "not in place"
        assert torch.equal(x, expected), f"{dtype} {reduce_op}: differs from all_reduce"

    # Not differentiable: refused where a gradient is needed, allowed under no_grad.
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"torch_tp::all_reduce_: x requires grad"):
        ops.all_reduce_(leaf.clone())
    with torch.no_grad():
        ops.all_reduce_(leaf)
    assert torch.equal(leaf.detach(), torch.full((3,), float(world_size)))
    # It bumps the version counter: a tensor saved for backward and changed by it is reported.
    y = leaf * 1
    z = y.sin()  # saves y
    with torch.no_grad():
        ops.all_reduce_(y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()

    torch.library.opcheck(torch.ops.torch_tp.all_reduce_.default,
                          (_rank_input(rank, (4, 3), torch.float64), "sum", name))

    def fn(t):
        u = t * 2
        torch.ops.torch_tp.all_reduce_(u, "sum", name)
        return u + 1

    x = _rank_input(rank, (4, 6), torch.float32)
    torch._dynamo.reset()
    # The same reduction of the same values: bitwise equal to eager.
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x)), "compiled all_reduce_ differs from eager"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_all_reduce_inplace(ranks, world_size):
    ranks(world_size).run(_check_all_reduce_inplace, timeout=300)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_integer(ranks, world_size):
    pool = ranks(world_size)
    for dtype in INT_DTYPES:
        for reduce_op in ["sum", "min", "max", "product"]:
            pool.run(_check_all_reduce, (4, 9), dtype, reduce_op, True)
    pool.run(_check_all_reduce, (4, 9), torch.int64, "sum", False)


def _check_all_gather(shape, dim, dtype, contiguous):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = _rank_input(rank, shape, dtype, contiguous=contiguous)
    ours = ops.all_gather(x, dim)
    assert ours.is_contiguous() and ours.dtype == dtype

    pieces = [torch.empty_like(x.contiguous()) for _ in range(world_size)]
    dist.all_gather(pieces, x.contiguous())
    assert torch.equal(ours, torch.cat(pieces, dim)), "differs from dist.all_gather + cat"
    reference = torch.cat([_rank_input(r, shape, dtype, contiguous=contiguous) for r in range(world_size)], dim)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather(ranks, world_size):
    pool = ranks(world_size)
    for dim in [0, 1, 2, -1, -3]:
        pool.run(_check_all_gather, (2, 3, 5), dim, torch.float32, True)
        pool.run(_check_all_gather, (2, 3, 5), dim, torch.float32, False)
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        pool.run(_check_all_gather, (4, 6), 1, dtype, True)
    pool.run(_check_all_gather, (0, 6), 0, torch.float32, True)
    pool.run(_check_all_gather, (5,), -1, torch.int32, True)


def _check_reduce_scatter(shape, dim, dtype, reduce_op, contiguous):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = _rank_input(rank, shape, dtype, reduce_op, contiguous=contiguous)
    ours = ops.reduce_scatter(x, dim, reduce_op)
    assert ours.is_contiguous() and ours.dtype == dtype

    # torch.distributed's reduce_scatter_tensor scatters along dim 0: move dim to the front.
    front = x.movedim(dim, 0).contiguous()
    piece = torch.empty((front.shape[0] // world_size,) + front.shape[1:], dtype=dtype)
    dist.reduce_scatter_tensor(piece, front, op=C10D_OPS[reduce_op])
    # On gloo, torch_tp folds the ranks' blocks itself, in rank order (NOTE
    # [reduce-scatter on gloo] in csrc/ops/comm.cpp): bitwise c10d's result
    # wherever the order cannot matter; otherwise within float roundoff of it.
    order_free = world_size <= 2 or not dtype.is_floating_point or reduce_op in ("min", "max")
    if order_free or dist.get_backend() != "gloo":
        assert torch.equal(ours, piece.movedim(0, dim)), "differs from dist.reduce_scatter_tensor"
    else:
        torch.testing.assert_close(ours, piece.movedim(0, dim), **_tolerance(dtype, world_size))

    full = reduce_reference(_all_inputs(world_size, shape, dtype, reduce_op, contiguous=contiguous), reduce_op)
    reference = full.chunk(world_size, dim)[rank]
    torch.testing.assert_close(ours.to(reference.dtype), reference, **_tolerance(dtype, world_size))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter(ranks, world_size):
    pool = ranks(world_size)
    for dim in [0, 1, -1]:
        pool.run(_check_reduce_scatter, (4, 8, 4), dim, torch.float32, "sum", True)
        pool.run(_check_reduce_scatter, (4, 8, 4), dim, torch.float32, "sum", False)
    for dtype in FLOAT_DTYPES:
        for reduce_op in REDUCE_OPS:
            pool.run(_check_reduce_scatter, (8, 3), 0, dtype, reduce_op, True)
    for dtype in INT_DTYPES:
        for reduce_op in ["sum", "min", "max", "product"]:
            pool.run(_check_reduce_scatter, (3, 8), 1, dtype, reduce_op, True)


# ---------------------------------------------------------------- uneven (torch.chunk) shards


def _check_uneven(n, dim):
    """Pieces of n rows as torch.chunk (DTensor's Shard(dim)) cuts them: gathered
    back whole, reduce-scattered into the same pieces, and differentiated through."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    full_shape = [3, 2, 4]
    full_shape[dim] = n
    full = _rank_input(0, tuple(full_shape), torch.float64, seed=7)
    pieces = list(full.chunk(world_size, dim))
    expected_piece = pieces[rank] if rank < len(pieces) else full.narrow(dim, n, 0)
    mine = ops.shard(full, dim)
    assert torch.equal(mine, expected_piece)
    assert mine.is_contiguous() and mine.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    assert ops.chunk_range(n, world_size, rank)[1] == expected_piece.size(dim)

    gathered = ops.all_gather(mine.clone().requires_grad_(), dim, full_size=n)
    assert torch.equal(gathered, full)

    x = _rank_input(rank, tuple(full_shape), torch.float64, seed=8).requires_grad_()
    piece = ops.reduce_scatter(x, dim)
    reduced = _all_inputs(world_size, tuple(full_shape), torch.float64, seed=8).sum(0)
    torch.testing.assert_close(piece, ops.shard(reduced, dim), **GRAD_TOL)

    # Backward: all_gather's is the sum reduce-scatter into the same pieces;
    # reduce_scatter's is the all-gather of the uneven pieces.
    leaf = mine.clone().requires_grad_()
    grads = [_rank_input(r, tuple(full_shape), torch.float64, seed=9) for r in range(world_size)]
    ops.all_gather(leaf, dim, full_size=n).backward(grads[rank])
    torch.testing.assert_close(leaf.grad, ops.shard(torch.stack(grads).sum(0), dim), **GRAD_TOL)
    piece.backward(ops.shard(grads[0], dim))
    torch.testing.assert_close(x.grad, grads[0], **GRAD_TOL)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_uneven_shards(ranks, world_size):
    pool = ranks(world_size)
    for n in [1, 2, 5, 7, 10]:
        for dim in [0, 1, -1]:
            pool.run(_check_uneven, n, dim)


def _check_tp_region_forward(shape):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = _rank_input(rank, shape, torch.float64)
    copied = ops.copy_to_tp_region(x)
    assert torch.equal(copied, x) and copied.data_ptr() != x.data_ptr()
    reduced = ops.reduce_from_tp_region(x)
    torch.testing.assert_close(reduced, _all_inputs(world_size, shape, torch.float64).sum(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tp_region_forward(ranks, world_size):
    ranks(world_size).run(_check_tp_region_forward, (3, 5))


# ---------------------------------------------------------------- gradients
# Each rank backpropagates its own upstream gradient g_r through the op; the
# reference builds all ranks' inputs in one process, applies the unsharded
# function that maps them to every rank's output, and differentiates
# sum_r <y_r, g_r>. float64 throughout: the adjoints are exact up to roundoff.

GRAD_TOL = dict(rtol=1e-10, atol=1e-12)


def _unsharded_outputs(name, xs, dim, reduce_op, world_size):
    """Every rank's output y_r of op ``name`` as a function of all inputs ``xs``."""
    if name == "all_reduce":
        reduced = {"sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "min": lambda s: s.amin(0),
                   "max": lambda s: s.amax(0), "product": lambda s: s.prod(0)}[reduce_op](torch.stack(xs))
        return [reduced] * world_size
    if name == "all_gather":
        return [torch.cat(xs, dim)] * world_size
    if name == "reduce_scatter":
        reduced = _unsharded_outputs("all_reduce", xs, dim, reduce_op, world_size)[0]
        return list(reduced.chunk(world_size, dim))
    raise AssertionError(name)


def _check_gradient(name, shape, dim, reduce_op, ties):
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def make_input(r):
        x = _rank_input(r, shape, torch.float64, reduce_op, seed=1)
        # Few distinct values so that several ranks tie for min/max.
        return x.round().clamp(-1, 1) if ties else x

    x = make_input(rank).requires_grad_()
    if name == "all_reduce":
        y = ops.all_reduce(x, reduce_op)
    elif name == "all_gather":
        y = ops.all_gather(x, dim)
    else:
        y = ops.reduce_scatter(x, dim, reduce_op)
    grads = [_rank_input(r, tuple(y.shape), torch.float64, seed=2) for r in range(world_size)]
    y.backward(grads[rank])

    xs = [make_input(r).requires_grad_() for r in range(world_size)]
    ys = _unsharded_outputs(name, xs, dim, reduce_op, world_size)
    loss = sum((y_r * g_r).sum() for y_r, g_r in zip(ys, grads))
    expected = torch.autograd.grad(loss, xs)[rank]
    torch.testing.assert_close(x.grad, expected, **GRAD_TOL)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradients(ranks, world_size):
    pool = ranks(world_size)
    for reduce_op in REDUCE_OPS:
        pool.run(_check_gradient, "all_reduce", (3, 4), 0, reduce_op, False)
        pool.run(_check_gradient, "reduce_scatter", (4, 8), 1, reduce_op, False)
    for reduce_op in ["min", "max"]:
        pool.run(_check_gradient, "all_reduce", (6, 5), 0, reduce_op, True)
        pool.run(_check_gradient, "reduce_scatter", (8, 5), 0, reduce_op, True)
    for dim in [0, 1, -1]:
        pool.run(_check_gradient, "all_gather", (2, 3, 4), dim, "sum", False)


def _check_tp_region_gradients(shape):
    """f and g under their contracts: f's input is one replicated tensor x (its
    gradient sums every rank's g_r); g's output is one replicated tensor y (every
    rank holds the same gradient g, which g passes through to each partial sum)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    grads = [_rank_input(r, shape, torch.float64, seed=3) for r in range(world_size)]

    x = _rank_input(0, shape, torch.float64).requires_grad_()
    ops.copy_to_tp_region(x).backward(grads[rank])
    torch.testing.assert_close(x.grad, torch.stack(grads).sum(0), **GRAD_TOL)

    partial = _rank_input(rank, shape, torch.float64).requires_grad_()
    ops.reduce_from_tp_region(partial).backward(grads[0])
    assert torch.equal(partial.grad, grads[0])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tp_region_gradients(ranks, world_size):
    ranks(world_size).run(_check_tp_region_gradients, (4, 3))


def _check_double_backward():
    """Backward communication goes through the ops, so it is differentiable too:
    for y = all_gather(x) and loss = sum(y^2)/2, grad_x = reduce_scatter(y) and
    d/dx of sum(grad_x * v) is p * v (each rank's block appears in every rank's y)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = _rank_input(rank, (2, 3), torch.float64).requires_grad_()
    y = ops.all_gather(x, 0)
    (grad_x,) = torch.autograd.grad((y * y).sum() / 2, x, create_graph=True)
    torch.testing.assert_close(grad_x, world_size * x, **GRAD_TOL)
    v = _rank_input(rank, (2, 3), torch.float64, seed=4)
    (grad2,) = torch.autograd.grad((grad_x * v).sum(), x)
    torch.testing.assert_close(grad2, world_size * v, **GRAD_TOL)


@pytest.mark.parametrize("world_size", [2])
def test_double_backward(ranks, world_size):
    ranks(world_size).run(_check_double_backward)


# ---------------------------------------------------------------- opcheck and compile


def _check_opcheck():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    x = _rank_input(rank, (4, 2 * world_size), torch.float64).requires_grad_()
    samples = [
        (torch.ops.torch_tp.all_reduce.default, (x, "sum", name)),
        (torch.ops.torch_tp.all_reduce.default, (x, "max", name)),
        (torch.ops.torch_tp.all_gather.default, (x, 1, name)),
        (torch.ops.torch_tp.all_gather.default, (x, -2, name)),
        (torch.ops.torch_tp.reduce_scatter.default, (x, 1, "sum", name)),
        (torch.ops.torch_tp.reduce_scatter.default, (x, -1, "avg", name)),
        (torch.ops.torch_tp.copy_to_tp_region.default, (x, name)),
        (torch.ops.torch_tp.reduce_from_tp_region.default, (x, name)),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("world_size", [1, 2])
def test_opcheck(ranks, world_size):
    ranks(world_size).run(_check_opcheck, timeout=300)


def _tp_block(x, w1, w2, group):
    """A function using every op: a Megatron MLP (f, column shard, row shard, g)
    followed by a sequence-parallel round trip (reduce-scatter, all-gather)."""
    h = torch.relu(ops.copy_to_tp_region(x, group) @ w1.t())
    y = ops.reduce_from_tp_region(h @ w2.t(), group)
    y = ops.all_reduce(y, "avg", group)
    shard = ops.reduce_scatter(y, 0, "sum", group)
    return ops.all_gather(shard * 2, 0, group)


def _check_compile():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    x = _rank_input(0, (2 * world_size, 8), torch.float32).requires_grad_()
    w1 = _rank_input(rank, (6, 8), torch.float32, seed=5).requires_grad_()
    w2 = _rank_input(rank, (8, 6), torch.float32, seed=6).requires_grad_()

    eager = _tp_block(x, w1, w2, group)
    eager.sum().backward()
    eager_grads = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None

    torch._dynamo.reset()
    compiled = torch.compile(_tp_block, fullgraph=True)(x, w1, w2, group)
    compiled.sum().backward()
    # Same ops, same order; inductor may fuse the pointwise work: fp32 roundoff.
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for t, g in zip((x, w1, w2), eager_grads):
        torch.testing.assert_close(t.grad, g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size", [2])
def test_compile_fullgraph(ranks, world_size):
    ranks(world_size).run(_check_compile, timeout=600)


# ---------------------------------------------------------------- groups


def _check_group_forms():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = torch.full((2,), float(rank + 1))
    expected = torch.full((2,), float(world_size * (world_size + 1) // 2))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for group in [None, dist.group.WORLD, dist.group.WORLD.group_name, mesh, mesh["tp"]]:
        assert torch.equal(ops.all_reduce(x, "sum", group), expected)
        assert torch.equal(torch_tp.all_gather(x[:1], 0, group), torch.arange(1.0, world_size + 1))

    if world_size == 4:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="1-D DeviceMesh, got a 2-D mesh"):
            ops.all_reduce(x, "sum", mesh2d)
        # The tp sub-groups are {0, 1} and {2, 3}.
        tp_sum = ops.all_reduce(x, "sum", mesh2d["tp"])
        first = 2 * (rank // 2) + 1
        assert torch.equal(tp_sum, torch.full((2,), float(first + first + 1)))
        # A group made with new_group: ranks {1, 2, 3}.
        sub = dist.new_group([1, 2, 3])
        if rank != 0:
            assert torch.equal(ops.all_gather(x[:1], 0, sub), torch.tensor([2.0, 3.0, 4.0]))

    with pytest.raises(TypeError, match="group must be"):
        ops.all_reduce(x, "sum", 3)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_group_forms(ranks, world_size):
    ranks(world_size).run(_check_group_forms)


# ---------------------------------------------------------------- errors


def _check_errors():
    world_size = dist.get_world_size()
    group = dist.group.WORLD.group_name
    x = torch.randn(4, 6)
    cases = [
        (lambda: ops.all_gather(x, 2), ["torch_tp::all_gather", "dim=2", "out of range"]),
        (lambda: ops.all_gather(x, -3), ["torch_tp::all_gather", "dim=-3"]),
        (lambda: ops.reduce_scatter(x, 5), ["torch_tp::reduce_scatter", "dim=5"]),
        (lambda: ops.all_gather(torch.tensor(1.0), 0), ["torch_tp::all_gather", "0-d"]),
        (lambda: ops.all_reduce(x, "sum", "no_such_group"), ["torch_tp::all_reduce", "group_name='no_such_group'"]),
        (lambda: torch.ops.torch_tp.all_gather(x, 0, "no_such_group"), ["torch_tp::all_gather", "no_such_group"]),
        (lambda: ops.all_reduce(x, "median"), ["torch_tp::all_reduce", "reduce_op='median'", "'sum'"]),
        (lambda: ops.reduce_scatter(x, 0, "mean"), ["torch_tp::reduce_scatter", "reduce_op='mean'"]),
        (lambda: ops.all_reduce(torch.ones(3, dtype=torch.int32), "avg"),
         ["torch_tp::all_reduce", "reduce_op='avg'", "Int"]),
        (lambda: ops.all_reduce(torch.ones(3, dtype=torch.bool), "max"), ["torch_tp::all_reduce", "x", "Bool"]),
        (lambda: ops.all_reduce(torch.ones(3, dtype=torch.complex64)), ["torch_tp::all_reduce", "ComplexFloat"]),
        (lambda: ops.copy_to_tp_region(x, "no_such_group"), ["torch_tp::copy_to_tp_region", "no_such_group"]),
    ]
    if world_size > 1:
        cases.append((lambda: ops.all_gather(torch.randn(4, 3), 1, full_size=10),
                      ["torch_tp::all_gather", "x.size(1)=3", "full_size=10", f"over {world_size} ranks"]))
    for call, fragments in cases:
        assert_error_names(call, fragments)
    # No tensor at all: the wrappers name the op and the argument (the
    # dispatcher, finding no tensor to dispatch on, would not).
    for name, call in [("all_reduce", lambda: ops.all_reduce(None)), ("all_reduce_", lambda: ops.all_reduce_(None)),
                       ("all_gather", lambda: ops.all_gather(None, 0)),
                       ("reduce_scatter", lambda: ops.reduce_scatter(None, 0)),
                       ("copy_to_tp_region", lambda: ops.copy_to_tp_region(None)),
                       ("reduce_from_tp_region", lambda: ops.reduce_from_tp_region(None))]:
        with pytest.raises(TypeError, match=rf"torch_tp.ops.{name}: x must be a Tensor, got None"):
            call()
    # The Meta kernels check the same way (torch.compile sees the same errors).
    with pytest.raises(RuntimeError, match=r"torch_tp::all_gather: dim=7"):
        torch.ops.torch_tp.all_gather(torch.empty(2, 3, device="meta"), 7, group)
    if world_size > 1:
        with pytest.raises(RuntimeError, match=r"x.size\(0\)=3 but rank \d's torch.chunk piece of full_size=10"):
            torch.ops.torch_tp.all_gather(torch.empty(3, device="meta"), 0, group, 10)


def _check_backend_dtype_error():
    assert_error_names(lambda: ops.all_reduce(torch.ones(3, 2, dtype=torch.int16)),
                       ["torch_tp::all_reduce", "gloo backend of group", "dtype Short", "[3, 2]"])


@pytest.mark.parametrize("world_size", [2])
def test_backend_error_names_the_op(ranks, world_size):
    ranks(world_size, "gloo").run(_check_backend_dtype_error)  # the message names gloo


@pytest.mark.parametrize("world_size", [1, 2])
def test_errors(ranks, world_size):
    ranks(world_size).run(_check_errors)


# ---------------------------------------------------------------- the harness itself


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    return dist.get_rank()


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        import time

        time.sleep(3600)
    return dist.get_rank()


def test_harness_carries_tracebacks_and_kills_hung_runs(ranks):
    import multirank

    pool = ranks(2)
    assert pool.run(dist.get_rank) == [0, 1]
    with pytest.raises(multirank.RankError, match=r"(?s)rank\(s\) \[1\].*ValueError: deliberate failure on rank 1"):
        pool.run(_raise_on_rank_one)
    assert pool.run(dist.get_rank) == [0, 1], "a failed run leaves a usable pool"
    with pytest.raises(multirank.RankTimeout, match=r"rank\(s\) \[1\] did not finish within 3 s"):
        pool.run(_hang_on_rank_one, timeout=3)
    assert not pool.alive
    assert ranks(2).run(dist.get_rank) == [0, 1], "a fresh pool replaces a killed one"


# ---------------------------------------------------------------- CUDA (run where a GPU is present)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _check_cuda_ops():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    group = dist.group.WORLD.group_name
    for dtype in [torch.float32, torch.bfloat16]:
        x = _rank_input(rank, (4 * world_size, 6), dtype).to(device)
        full = _all_inputs(world_size, (4 * world_size, 6), dtype)
        tol = _tolerance(dtype, world_size)
        torch.testing.assert_close(torch.ops.torch_tp.all_reduce(x, "sum", group).cpu().double(),
                                   full.double().sum(0), **tol)
        assert torch.equal(torch.ops.torch_tp.all_gather(x, 1, group).cpu(), torch.cat(list(full), 1))
        # On gloo the op runs as an all_to_all (NOTE [reduce-scatter on gloo]), which gloo stages
        # through host memory for CUDA tensors.
        torch.testing.assert_close(
            torch.ops.torch_tp.reduce_scatter(x, 0, "sum", group).cpu().double(),
            full.double().sum(0).chunk(world_size, 0)[rank], **tol)
    x = _rank_input(rank, (3, 4), torch.float64).to(device).requires_grad_()
    torch.ops.torch_tp.all_gather(x, 0, group).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, world_size), **GRAD_TOL)


@needs_cuda
def test_cuda_nccl_world_size_1(ranks):
    ranks(1, "cpu:gloo,cuda:nccl").run(_check_cuda_ops)


@needs_cuda
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_gloo(ranks, world_size):
    ranks(world_size, "gloo").run(_check_cuda_ops)


# ---------------------------------------------------------------- double backward of every collective


def _check_collective_gradgrad(op, reduce_op):
    """gradcheck and gradgradcheck of one collective over all ranks (see tp_gradcheck.py)."""
    from tp_gradcheck import check_grad_and_gradgrad, seeded, shard_in, stack_out

    world_size = dist.get_world_size()
    name = dist.group.WORLD.group_name
    X = seeded((world_size, 2, 3), 1)  # distinct values: no ties under min / max
    if op == "all_reduce":
        def fn(X):
            return stack_out(torch.ops.torch_tp.all_reduce(shard_in(X, 0).squeeze(0), reduce_op, name))
    elif op == "all_gather":
        def fn(X):
            return stack_out(torch.ops.torch_tp.all_gather(shard_in(X, 0).squeeze(0), 1, name))
    elif op == "reduce_scatter":
        X = seeded((world_size, 2 * world_size, 3), 1)

        def fn(X):
            return stack_out(torch.ops.torch_tp.reduce_scatter(shard_in(X, 0).squeeze(0), 0, reduce_op, name))
    elif op == "copy_to_tp_region":
        X = seeded((2, 3), 1)

        def fn(X):
            return stack_out(torch.ops.torch_tp.copy_to_tp_region(X, name))
    else:
        def fn(X):
            return torch.ops.torch_tp.reduce_from_tp_region(shard_in(X, 0).squeeze(0), name)
    return check_grad_and_gradgrad(fn, (X,))


@pytest.mark.parametrize("world_size", [1, 2])
def test_collectives_double_backward(ranks, world_size):
    """Every collective's backward is itself differentiable, with the right
    second derivative (copy_to_tp_region's backward used to be a plain
    all_reduce, reduce_from_tp_region's an identity, so a backward with
    create_graph=True counted the replicated gradient p times or not at all)."""
    pool = ranks(world_size)
    for reduce_op in REDUCE_OPS:
        pool.run(_check_collective_gradgrad, "all_reduce", reduce_op)
        pool.run(_check_collective_gradgrad, "reduce_scatter", reduce_op)
    for op in ["all_gather", "copy_to_tp_region", "reduce_from_tp_region"]:
        pool.run(_check_collective_gradgrad, op, None)


# ---------------------------------------------------------------- NaN, cross-rank checks


def _check_nan_under_min_max_ops():
    """The ops' min/max follow torch.amax's NaN rule wherever torch_tp computes;
    an all_reduce on gloo is gloo's reduction, whose rule is recorded here."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    nan = float("nan")
    inputs = [torch.tensor([nan, 1, 2, 5]), torch.tensor([3, nan, 4, 0])]
    stacked = torch.stack(inputs)
    on_gloo = dist.get_backend() == "gloo"
    for reduce_op, reference in (("max", stacked.amax(0)), ("min", stacked.amin(0))):
        # reduce_scatter on gloo is torch_tp's own fold (NOTE [reduce-scatter on gloo]).
        piece = ops.reduce_scatter(torch.cat([inputs[rank]] * world_size), 0, reduce_op)
        torch.testing.assert_close(piece, reference, equal_nan=True, atol=0, rtol=0)
        ours = ops.all_reduce(inputs[rank], reduce_op)
        if on_gloo:
            # gloo keeps a NaN only from the rank its fold starts with (rank 0 here).
            gloo_rule = {"max": [nan, 1.0, 4.0, 5.0], "min": [nan, 1.0, 2.0, 0.0]}[reduce_op]
            torch.testing.assert_close(ours, torch.tensor(gloo_rule), equal_nan=True, atol=0, rtol=0)
        else:
            torch.testing.assert_close(ours, reference, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("world_size", [2])
def test_nan_under_min_max(ranks, world_size):
    ranks(world_size).run(_check_nan_under_min_max_ops)


DEBUG_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def _check_cross_rank_mismatch(case, name=None):
    """Each call moves the same number of elements on every rank but differs
    in a dim or a shape; it must raise on every rank naming op and argument."""
    rank = dist.get_rank()
    name = name or dist.group.WORLD.group_name
    x = torch.randn(4, 4, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)
    if case == "all_gather_dim":
        torch.ops.torch_tp.all_gather(x, rank, name)
    elif case == "reduce_scatter_dim":
        torch.ops.torch_tp.reduce_scatter(x, rank, "sum", name)
    elif case == "column_gather_dim":
        torch.ops.torch_tp.column_parallel_linear(torch.randn(2, 2, 4, dtype=torch.float64), w, None, name, rank)
    elif case == "row_scatter_dim":
        torch.ops.torch_tp.row_parallel_linear(torch.randn(2, 2, 4, dtype=torch.float64), w, None, name, rank)
    elif case == "all_reduce_shape":
        torch.ops.torch_tp.all_reduce(torch.ones((2, 3) if rank == 0 else (3, 2)), "sum", name)
    elif case == "reduce_op":
        torch.ops.torch_tp.all_reduce(x, "max" if rank == 0 else "min", name)


@pytest.mark.parametrize("case, fragments", [
    ("all_gather_dim", ["torch_tp::all_gather", "dim=0", "dim=1"]),
    ("reduce_scatter_dim", ["torch_tp::reduce_scatter", "dim=0", "dim=1"]),
    ("column_gather_dim", ["torch_tp::column_parallel_linear", "gather_dim=0", "gather_dim=1"]),
    ("row_scatter_dim", ["torch_tp::row_parallel_linear", "scatter_dim=0", "scatter_dim=1"]),
    ("all_reduce_shape", ["torch_tp::all_reduce", "[2, 3]", "[3, 2]"]),
    ("reduce_op", ["torch_tp::all_reduce", "'max'", "'min'"]),
])
def test_cross_rank_mismatch_is_an_error_in_debug_mode(ranks, case, fragments):
    """These used to return a different answer on each rank, silently, on
    both backends. With TORCH_DISTRIBUTED_DEBUG=DETAIL every rank raises."""
    assert_error_names(lambda: ranks(2, env=DEBUG_ENV).run(_check_cross_rank_mismatch, case),
                       ["rank(s) [0, 1]", *fragments], AssertionError)


def _dim_mismatch_message(case):
    """The message of `case` on a group of the torch_tp backend, in the default mode."""
    group = dist.new_group(backend="torch_tp")
    try:
        with pytest.raises(RuntimeError) as info:
            _check_cross_rank_mismatch(case, group.group_name)
        return str(info.value)
    finally:
        dist.destroy_process_group(group)  # the mismatch left it unusable


@pytest.mark.parametrize("case, op, arg", [
    ("all_gather_dim", "torch_tp::all_gather", "dim"),
    ("reduce_scatter_dim", "torch_tp::reduce_scatter", "dim"),
    ("column_gather_dim", "torch_tp::column_parallel_linear", "gather_dim"),
    ("row_scatter_dim", "torch_tp::row_parallel_linear", "scatter_dim"),
])
def test_dim_mismatch_is_an_error_on_the_torch_tp_backend(ranks, case, op, arg):
    """The torch_tp backend's call header carries the ops' dim (NOTE [the
    ops' dim in the call header]): without TORCH_DISTRIBUTED_DEBUG, every
    rank's error names the op, the argument and both ranks' dims."""
    for rank, message in enumerate(ranks(2).run(_dim_mismatch_message, case)):
        assert_message_names(message, [op, "mismatch between ranks", f"{arg}={rank}", "dim=0", "dim=1"],
                             f"rank {rank}'s error")


def _check_debug_mode_passes_matching_calls():
    x = _rank_input(dist.get_rank(), (4, 6), torch.float64)
    y = ops.all_gather(x, 1)
    assert y.shape == (4, 6 * dist.get_world_size())
    ops.reduce_scatter(y, 1, "sum")
    ops.all_gather(ops.shard(torch.ones(5, 2), 0), 0, full_size=5)  # uneven pieces are fine


def test_debug_mode_passes_matching_calls(ranks):
    ranks(3, env=DEBUG_ENV).run(_check_debug_mode_passes_matching_calls)
