"""Sharded linear and embedding ops against the unsharded nn.Linear / nn.Embedding.

Every rank builds the full weights and input (same seed everywhere), takes its
torch.chunk shard (DTensor's Shard(dim), uneven when the size does not divide),
runs the op, and compares output and gradients with the unsharded module run
in the same process. The upstream gradient G of the full output is the same on
every rank; a rank whose output is a shard backpropagates its shard of G.

Tolerances, relative to the largest magnitude of the reference tensor (so
entries near zero are judged on the tensor's scale):
  float64   1e-10: reordered sums, ~K * 2^-53 per GEMM.
  float32   1e-5:  GEMM blocking and the p-way split
            reorder K-term sums (K <= 64 here, 2^-24 each).
  bfloat16  3e-2:  8-bit significands (2^-8 = 3.9e-3); a row-parallel output
            is rounded in each rank's partial GEMM and again in each of up to
            p - 1 bf16 additions of the reduction, so up to ~5 roundings at
            p = 4, plus the reference's own rounding of its inputs.
  float16   1e-2:  11-bit significands (2^-11 = 4.9e-4), the same ~5 roundings.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_tp import ops

from _compare import assert_close, assert_error_names

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def _full(shape, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _group():
    return dist.group.WORLD.group_name


def _param(t):
    return t.detach().clone().requires_grad_()


# ---------------------------------------------------------------- linear


def _unsharded_linear(dtype, in_features, out_features, seq, bias, activation, seed):
    """The full inputs (weight, bias, x [2, seq, in], grad of y) drawn from seeds
    ``seed`` .. ``seed + 3``, and the unsharded reference after its backward:
    (ref_x, ref_w, ref_b) holding their gradients, and ref_y = act(x @ W^T + b)."""
    weight = _full((out_features, in_features), seed, dtype)
    b = _full((out_features,), seed + 1, dtype) if bias else None
    x = _full((2, seq, in_features), seed + 2, dtype)
    grad = _full((2, seq, out_features), seed + 3, dtype)
    ref_x, ref_w = _param(x), _param(weight)
    ref_b = _param(b) if bias else None
    ref_y = F.linear(ref_x, ref_w, ref_b)
    if activation == "gelu_tanh":
        ref_y = F.gelu(ref_y, approximate="tanh")
    ref_y.backward(grad)
    return (weight, b, x, grad), (ref_x, ref_w, ref_b, ref_y)


def _check_column(dtype, in_features, out_features, seq, bias, sequence_parallel, activation):
    """column_parallel_linear vs nn.Linear (+ GELU): output shard along the
    features; grad_x all-reduced (or reduce-scattered along the sequence)."""
    (weight, b, x, grad), (ref_x, ref_w, ref_b, ref_y) = _unsharded_linear(
        dtype, in_features, out_features, seq, bias, activation, seed=1)
    w_r = _param(ops.shard(weight, 0))
    b_r = _param(ops.shard(b, 0)) if bias else None
    x_r = _param(ops.shard(x, 1) if sequence_parallel else x)
    y = torch.ops.torch_tp.column_parallel_linear(
        x_r, w_r, b_r, _group(), 1 if sequence_parallel else None, seq if sequence_parallel else None, activation)
    assert_close(y, ops.shard(ref_y, -1), "output", TOL[dtype])
    y.backward(ops.shard(grad, -1))
    assert_close(x_r.grad, ops.shard(ref_x.grad, 1) if sequence_parallel else ref_x.grad, "grad_x", TOL[dtype])
    assert_close(w_r.grad, ops.shard(ref_w.grad, 0), "grad_weight", TOL[dtype])
    if bias:
        assert_close(b_r.grad, ops.shard(ref_b.grad, 0), "grad_bias", TOL[dtype])


def _check_row(dtype, in_features, out_features, seq, bias, sequence_parallel):
    """row_parallel_linear vs nn.Linear: input shard along the features, output
    all-reduced (or reduce-scattered along the sequence), bias added once."""
    (weight, b, x, grad), (ref_x, ref_w, ref_b, ref_y) = _unsharded_linear(
        dtype, in_features, out_features, seq, bias, None, seed=5)
    w_r = _param(ops.shard(weight, 1))
    b_full = _param(b) if bias else None
    x_r = _param(ops.shard(x, -1))
    y = torch.ops.torch_tp.row_parallel_linear(x_r, w_r, b_full, _group(), 1 if sequence_parallel else None)
    assert_close(y, ops.shard(ref_y, 1) if sequence_parallel else ref_y, "output", TOL[dtype])
    y.backward(ops.shard(grad, 1) if sequence_parallel else grad)
    assert_close(x_r.grad, ops.shard(ref_x.grad, -1), "grad_x", TOL[dtype])
    assert_close(w_r.grad, ops.shard(ref_w.grad, 1), "grad_weight", TOL[dtype])
    if bias:
        # Complete on every rank, also under sequence parallelism (see NOTE [no partial gradients]).
        assert_close(b_full.grad, ref_b.grad, "grad_bias", TOL[dtype])


def _check_column_partial_grad_input():
    """partial_grad_input=True leaves grad_x as this rank's partial sum: summed
    over the ranks it is nn.Linear's grad_x; the weight gradients are unchanged."""
    dtype = torch.float64
    weight, b = _full((14, 10), 1, dtype), _full((14,), 2, dtype)
    x, grad = _full((2, 5, 10), 3, dtype), _full((2, 5, 14), 4, dtype)
    ref_x, ref_w = _param(x), _param(weight)
    F.linear(ref_x, ref_w, b).backward(grad)
    x_r, w_r = _param(x), _param(ops.shard(weight, 0))
    y = torch.ops.torch_tp.column_parallel_linear(x_r, w_r, ops.shard(b, 0), _group(), partial_grad_input=True)
    y.backward(ops.shard(grad, -1))
    assert_close(ops.all_reduce(x_r.grad, "sum"), ref_x.grad, "summed partial grad_x", TOL[dtype])
    assert_close(w_r.grad, ops.shard(ref_w.grad, 0), "grad_weight", TOL[dtype])
    # Refused in the forward (not accepted there and refused only in
    # the backward), with and without autograd, and on Meta.
    x_shard = ops.shard(x, 1)
    for args in [(_param(x_shard), w_r), (x_shard, w_r.detach()), (x_shard.to("meta"), w_r.detach().to("meta"))]:
        with pytest.raises(RuntimeError, match="column_parallel_linear: partial_grad_input=True does not combine "
                                               "with gather_dim=1"):
            torch.ops.torch_tp.column_parallel_linear(*args, None, _group(), 1, 5, partial_grad_input=True)


@pytest.mark.parametrize("world_size", [1, 3])
def test_column_partial_grad_input(ranks, world_size):
    ranks(world_size).run(_check_column_partial_grad_input)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_column_parallel_linear(ranks, world_size):
    pool = ranks(world_size)
    for dtype in [torch.float32, torch.float64, torch.bfloat16, torch.float16]:
        for sequence_parallel in [False, True]:
            # 16 -> 24 features splits evenly over 1, 2, 3 and 4 ranks; 10 -> 14 does not.
            pool.run(_check_column, dtype, 16, 24, 8, True, sequence_parallel, "none")
            pool.run(_check_column, dtype, 10, 14, 7, True, sequence_parallel, "none")
    pool.run(_check_column, torch.float32, 12, 20, 6, False, False, "none")
    pool.run(_check_column, torch.float64, 12, 20, 5, True, True, "gelu_tanh")
    pool.run(_check_column, torch.float32, 12, 20, 6, True, False, "gelu_tanh")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_row_parallel_linear(ranks, world_size):
    pool = ranks(world_size)
    for dtype in [torch.float32, torch.float64, torch.bfloat16, torch.float16]:
        for sequence_parallel in [False, True]:
            pool.run(_check_row, dtype, 24, 16, 8, True, sequence_parallel)
            pool.run(_check_row, dtype, 14, 10, 7, True, sequence_parallel)
    pool.run(_check_row, torch.float32, 20, 12, 6, False, False)
    pool.run(_check_row, torch.float32, 3, 5, 2, True, True)  # more ranks than rows and features


# The CPU decode GEMV (csrc/ops/gemv_cpu.cpp) takes the forward of bfloat16,
# float16 and float32 inputs with at most 8 rows of x on an x86-64 CPU with
# AVX-512 BF16 or AVX2 (elsewhere ATen computes them and these tests check
# ATen). Its sum is float32 (rounded once to the half-precision dtype), so it
# is compared with F.linear computed in float32 (and then rounded), on
# tolerances far tighter than TOL's:
#   bfloat16, float16, GEMV_TOL: the two float32 sums differ only in their
#            order (~K * 2^-24), but one may round up and the other down where
#            they straddle a rounding boundary: one ulp of an entry, at most
#            2^-7 of max |y| in bfloat16 (8 significant bits), 2^-10 in
#            float16 (11). A lost K element (a tail) is ~1/sqrt(K) of |y|, far
#            above.
#   float32, _float32_gemv_tol: nothing is rounded but the sums, and the two
#            differ only in their order. A float32 sum of products, in any
#            order, is within d * 2^-24 * sum |term| of the exact one, d the
#            number of roundings a term goes through (Higham's gamma_d, first
#            order): at most K + 1 in ATen's (a rounded product, K additions
#            with the bias), ceil(K / 16) + 5 in the kernel's (fused
#            multiply-adds in 16 lanes, 4 levels summing the lanes, the bias);
#            so the two are within 2 * (K + 8) * 2^-24 * max_j sum_k |x_k w_jk| + |b_j|.
#            With random data that is ~K^1.5 * 1e-7 of max |y| (~3e-4 at
#            K = 512), a lost K element still ~1/sqrt(K) of it.
#   twice those after a second operation: GELU (slope <= 1.13) of the GEMM
#            output, or the row-parallel bias added after the reduction (one
#            more rounding, in half precision one ulp).
GEMV_TOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10}
GEMV_MAX_ROWS = 8  # kSmallBatchRows in csrc/ops/gemv_cpu.h


def _rounded_linear(x, weight, b, activation="none"):
    y = F.linear(x.float(), weight.float(), None if b is None else b.float())
    return (F.gelu(y, approximate="tanh") if activation == "gelu_tanh" else y).to(x.dtype)


def _float32_gemv_tol(x, weight, b, expected):
    """The float32 bound above, relative to max |expected| as assert_close takes it."""
    terms = x.double().abs() @ weight.double().abs().t() + (0 if b is None else b.double().abs())
    return 2 * (x.size(-1) + 8) * 2**-24 * terms.max().item() / max(expected.double().abs().max().item(), 1e-30)


def _assert_gemv_close(actual, x, weight, b, what, activation="none", operations=1):
    """actual against F.linear in float32 (rounded to x's dtype), on the
    tolerance above for x's dtype times the operations after the sum's."""
    expected = _rounded_linear(x, weight, b, activation)
    tol = _float32_gemv_tol(x, weight, b, expected) if x.dtype == torch.float32 else GEMV_TOL[x.dtype]
    assert_close(actual, expected, what, operations * tol)


def _check_decode_gemv(dtype):
    """column_parallel_linear / row_parallel_linear with few rows, the decode
    GEMV's case: every row count it takes (and one more, ATen's), a 3-D x
    [1, 1, K], with and without bias, K and N not multiples of the vector
    width (K tails) nor of the rows per block (N tails)."""
    column, row = torch.ops.torch_tp.column_parallel_linear, torch.ops.torch_tp.row_parallel_linear
    for seed, (in_features, out_features) in enumerate([(100, 37), (64, 16), (512, 40), (33, 1), (1, 5), (70, 9)]):
        weight = _full((out_features, in_features), seed, dtype)
        b = _full((out_features,), seed + 100, dtype)
        shapes = [(m, in_features) for m in range(1, GEMV_MAX_ROWS + 2)] + [(1, 1, in_features), (2, 4, in_features)]
        for shape in shapes:
            x = _full(shape, seed + 200, dtype)
            what = f"{dtype}, x {tuple(shape)}, weight {tuple(weight.shape)}"
            for bias in [b, None]:
                _assert_gemv_close(column(x, weight, bias, _group()), x, weight, bias,
                                   f"column, {what}, bias={bias is not None}")
            _assert_gemv_close(column(x, weight, b, _group(), activation="gelu_tanh"), x, weight, b,
                               f"column + gelu_tanh, {what}", "gelu_tanh", 2)
            _assert_gemv_close(row(x, weight, None, _group()), x, weight, None, f"row, {what}")
            _assert_gemv_close(row(x, weight, b, _group()), x, weight, b, f"row + bias, {what}", operations=2)


def _check_decode_gemv_fallback():
    """Inputs the decode GEMV does not take go to the ops' general GEMM, local_mm
    (ATen's, or on a CPU without a native bfloat16 / float16 GEMM its float32
    panels, NOTE [half-precision GEMMs through float32 panels]): x's rows
    strided in K, a transposed (non-contiguous) weight or bias. Either way each
    entry is F.linear's in float32 rounded once, so within GEMV_TOL."""
    gen_w, gen_x = _full((40, 100), 1, torch.bfloat16), _full((2, 200), 2, torch.bfloat16)
    b = _full((80,), 3, torch.bfloat16)[::2]  # non-contiguous bias
    cases = {
        "x strided in K": (gen_x[:, ::2], gen_w, b.contiguous()),
        "weight transposed": (gen_x[:, :100], gen_w.t().contiguous().t(), b.contiguous()),
        "bias strided": (gen_x[:, :100], gen_w, b),
    }
    for what, (x, weight, bias) in cases.items():
        assert not (x.is_contiguous() and weight.is_contiguous() and bias.is_contiguous())
        y = torch.ops.torch_tp.column_parallel_linear(x, weight, bias, _group())
        assert_close(y, _rounded_linear(x, weight, bias), f"column vs float32, {what}", GEMV_TOL[x.dtype])


def _check_decode_gemv_threads(dtype):
    """With several intra-op threads the GEMV splits the output features over
    them (at::parallel_for): each block, its tail and the bias still line up."""
    threads = torch.get_num_threads()
    weight, b = _full((1001, 100), 1, dtype), _full((1001,), 2, dtype)
    x = _full((3, 100), 3, dtype)
    torch.set_num_threads(2)
    try:
        y = torch.ops.torch_tp.column_parallel_linear(x, weight, b, _group())
    finally:
        torch.set_num_threads(threads)
    _assert_gemv_close(y, x, weight, b, f"column, {dtype}, 2 threads")


@pytest.mark.parametrize("check, args", [
    (_check_decode_gemv, (torch.bfloat16,)), (_check_decode_gemv, (torch.float16,)),
    (_check_decode_gemv, (torch.float32,)), (_check_decode_gemv_fallback, ()),
    (_check_decode_gemv_threads, (torch.bfloat16,)), (_check_decode_gemv_threads, (torch.float16,)),
    (_check_decode_gemv_threads, (torch.float32,)),
], ids=["bf16", "fp16", "fp32", "fallback", "threads-bf16", "threads-fp16", "threads-fp32"])
def test_decode_gemv(ranks, check, args):
    ranks(1).run(check, *args)


def _mlp(x, w1, b1, w2, b2, group, sequence_parallel, seq):
    h = torch.ops.torch_tp.column_parallel_linear(
        x, w1, b1, group, 1 if sequence_parallel else None, seq if sequence_parallel else None, "gelu_tanh")
    return torch.ops.torch_tp.row_parallel_linear(h, w2, b2, group, 1 if sequence_parallel else None)


def _check_compiled_mlp(sequence_parallel):
    """torch.compile(fullgraph=True) of a column -> row MLP equals eager, forward and backward."""
    hidden, seq = 8, 6
    group = _group()
    w1, b1 = _param(ops.shard(_full((32, hidden), 1, torch.float32), 0)), _param(ops.shard(_full((32,), 2, torch.float32), 0))
    w2, b2 = _param(ops.shard(_full((hidden, 32), 3, torch.float32), 1)), _param(_full((hidden,), 4, torch.float32))
    x = _full((2, seq, hidden), 5, torch.float32)
    x = _param(ops.shard(x, 1) if sequence_parallel else x)
    params = [x, w1, b1, w2, b2]

    eager = _mlp(*params, group, sequence_parallel, seq)
    eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(_mlp, fullgraph=True)(*params, group, sequence_parallel, seq)
    compiled.square().sum().backward()
    assert_close(compiled, eager, "compiled output", TOL[torch.float32])
    for p, g in zip(params, eager_grads):
        assert_close(p.grad, g, "compiled grad", TOL[torch.float32])


@pytest.mark.parametrize("world_size", [2])
def test_compile_column_row_mlp(ranks, world_size):
    pool = ranks(world_size)
    pool.run(_check_compiled_mlp, False, timeout=600)
    pool.run(_check_compiled_mlp, True, timeout=600)


# ---------------------------------------------------------------- frozen parameters


def _leaf(t, requires_grad):
    return t.detach().clone().requires_grad_(requires_grad)


def _backward_work(backward):
    """Runs ``backward()`` under torch.profiler and returns what it ran on this
    rank: (GEMMs, collectives). The backward kernels' GEMMs are aten::mm, and
    every collective reaches its backend through a c10d:: op (ProcessGroup
    dispatches them) or, on the torch_tp backend, as a direct call that the
    profiler shows as torch_tp_backend::<collective>, so neither escapes the count."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        backward()
    names = [event.name for event in prof.events()]
    return names.count("aten::mm"), sum(name.startswith(("c10d::", "torch_tp_backend::")) for name in names)


def _check_frozen(layer, sequence_parallel, x_grad, w_grad, b_grad):
    """A frozen weight (and bias) or an input that needs no gradient costs
    nothing in the backward (NOTE [skipped gradients] in linear.cpp): the
    gradients asked for are nn.Linear's, nothing else gets one, and the
    backward runs one GEMM per gradient of x and of the weight, and only the
    collectives those need. Under create_graph (NOTE [double backward]) the
    gradients asked for are nn.Linear's too."""
    dtype, seq = torch.float64, 6
    column = layer == "column"
    in_features, out_features = (10, 14) if column else (14, 10)
    weight, b = _full((out_features, in_features), 1, dtype), _full((out_features,), 2, dtype)
    x, grad = _full((2, seq, in_features), 3, dtype), _full((2, seq, out_features), 4, dtype)

    ref_x, ref_w, ref_b = _leaf(x, x_grad), _leaf(weight, w_grad), _leaf(b, b_grad)
    ref_y = F.linear(ref_x, ref_w, ref_b)
    dim = 1 if sequence_parallel else None
    if column:
        ref_y = F.gelu(ref_y, approximate="tanh")
        x_r = _leaf(ops.shard(x, 1) if sequence_parallel else x, x_grad)
        w_r, b_r = _leaf(ops.shard(weight, 0), w_grad), _leaf(ops.shard(b, 0), b_grad)
        def forward():
            return torch.ops.torch_tp.column_parallel_linear(
                x_r, w_r, b_r, _group(), dim, seq if sequence_parallel else None, "gelu_tanh")
        grad_r = ops.shard(grad, -1)
        pieces = {"x": (lambda t: ops.shard(t, 1)) if sequence_parallel else (lambda t: t),
                  "weight": lambda t: ops.shard(t, 0), "bias": lambda t: ops.shard(t, 0)}
    else:
        x_r = _leaf(ops.shard(x, -1), x_grad)
        w_r, b_r = _leaf(ops.shard(weight, 1), w_grad), _leaf(b, b_grad)
        def forward():
            return torch.ops.torch_tp.row_parallel_linear(x_r, w_r, b_r, _group(), dim)
        grad_r = ops.shard(grad, 1) if sequence_parallel else grad
        pieces = {"x": lambda t: ops.shard(t, -1), "weight": lambda t: ops.shard(t, 1), "bias": lambda t: t}
    ref_y.backward(grad)
    y = forward()
    gemms, collectives = _backward_work(lambda: y.backward(grad_r))

    tensors = [("x", x_r, ref_x), ("weight", w_r, ref_w), ("bias", b_r, ref_b)]
    for name, mine, ref in tensors:
        if ref.requires_grad:
            assert_close(mine.grad, pieces[name](ref.grad), f"grad of {name}", TOL[dtype])
        else:
            assert mine.grad is None, f"{name} got a gradient it does not require"
    wanted = [(name, mine, ref) for name, mine, ref in tensors if ref.requires_grad]
    firsts = torch.autograd.grad(forward(), [mine for _, mine, _ in wanted], grad_r, create_graph=True)
    for (name, _, ref), first in zip(wanted, firsts):
        assert_close(first, pieces[name](ref.grad), f"create_graph grad of {name}", TOL[dtype])
    # Column: grad_x all-reduced (reduce-scattered under sequence parallelism),
    # x re-gathered under sequence parallelism for grad_weight only. Row: grad
    # all-gathered under sequence parallelism, for any gradient.
    if column:
        expected_collectives = int(x_grad) + int(sequence_parallel and w_grad)
    else:
        expected_collectives = int(sequence_parallel)
    assert (gemms, collectives) == (int(x_grad) + int(w_grad), expected_collectives), (
        f"{layer} backward (x_grad={x_grad}, w_grad={w_grad}, sequence_parallel={sequence_parallel}) ran "
        f"{gemms} GEMMs and {collectives} collectives; expected {int(x_grad) + int(w_grad)} and "
        f"{expected_collectives}")


@pytest.mark.parametrize("world_size", [2])
def test_frozen_parameters_cost_nothing(ranks, world_size):
    pool = ranks(world_size)
    for layer in ["column", "row"]:
        for sequence_parallel in [False, True]:
            # (x, weight, bias) requires_grad: neither frozen, frozen weight,
            # frozen input, both, and a frozen layer (weight and bias).
            for flags in [(True, True, True), (True, False, True), (False, True, True), (False, False, True),
                          (True, False, False)]:
                pool.run(_check_frozen, layer, sequence_parallel, *flags)


def _check_frozen_compiled(sequence_parallel, x_grad, w_grad):
    """The column -> row MLP under torch.compile(fullgraph=True) with frozen
    weights (biases trained) or an input that needs no gradient: gradients
    against the unsharded MLP, and the compiled backward's GEMMs and
    collectives counted on its second run (the first compiles it)."""
    dtype, hidden, seq = torch.float64, 8, 6
    group = _group()
    W1, B1 = _full((32, hidden), 1, dtype), _full((32,), 2, dtype)
    W2, B2 = _full((hidden, 32), 3, dtype), _full((hidden,), 4, dtype)
    X = _full((2, seq, hidden), 5, dtype)
    ref = [_leaf(X, x_grad), _leaf(W1, w_grad), _leaf(B1, True), _leaf(W2, w_grad), _leaf(B2, True)]
    F.linear(F.gelu(F.linear(ref[0], ref[1], ref[2]), approximate="tanh"), ref[3], ref[4]).square().sum().backward()

    x = _leaf(ops.shard(X, 1) if sequence_parallel else X, x_grad)
    params = [x, _leaf(ops.shard(W1, 0), w_grad), _leaf(ops.shard(B1, 0), True), _leaf(ops.shard(W2, 1), w_grad),
              _leaf(B2, True)]
    torch._dynamo.reset()
    compiled = torch.compile(_mlp, fullgraph=True)
    compiled(*params, group, sequence_parallel, seq).square().sum().backward()
    for p in params:
        p.grad = None
    loss = compiled(*params, group, sequence_parallel, seq).square().sum()
    gemms, collectives = _backward_work(loss.backward)

    cuts = [(lambda t: ops.shard(t, 1) if sequence_parallel else t), (lambda t: ops.shard(t, 0)),
            (lambda t: ops.shard(t, 0)), (lambda t: ops.shard(t, 1)), (lambda t: t)]
    for name, mine, cut, r in zip(["x", "w1", "b1", "w2", "b2"], params, cuts, ref):
        if r.requires_grad:
            assert_close(mine.grad, cut(r.grad), f"compiled grad of {name}", TOL[dtype])
        else:
            assert mine.grad is None, f"compiled: {name} got a gradient it does not require"
    # Column: grad_x GEMM and collective if x needs a gradient, grad_w1 GEMM
    # (and x's re-gather under sequence parallelism) if w1 does. Row: its
    # input needs a gradient either way (x or w1 does); grad_w2 GEMM if w2
    # needs one; grad's all-gather under sequence parallelism.
    expected = (int(x_grad) + int(w_grad) + 1 + int(w_grad),
                int(x_grad) + int(sequence_parallel and w_grad) + int(sequence_parallel))
    assert (gemms, collectives) == expected, (
        f"compiled backward (x_grad={x_grad}, w_grad={w_grad}, sequence_parallel={sequence_parallel}) ran "
        f"{gemms} GEMMs and {collectives} collectives; expected {expected[0]} and {expected[1]}")


@pytest.mark.parametrize("world_size", [2])
def test_frozen_parameters_cost_nothing_compiled(ranks, world_size):
    pool = ranks(world_size)
    for sequence_parallel in [False, True]:
        for x_grad, w_grad in [(True, False), (False, True)]:
            pool.run(_check_frozen_compiled, sequence_parallel, x_grad, w_grad, timeout=600)


def _check_linear_opcheck():
    group = _group()
    world_size = dist.get_world_size()
    x = _full((2, 3 * world_size, 8), 1, torch.float64).requires_grad_()
    x_shard = ops.shard(x.detach(), 1).requires_grad_()
    w_col = _full((6, 8), 2, torch.float64).requires_grad_()
    b_col = _full((6,), 3, torch.float64).requires_grad_()
    w_row = _full((5, 8), 4, torch.float64).requires_grad_()
    b_row = _full((5,), 5, torch.float64).requires_grad_()
    col = torch.ops.torch_tp.column_parallel_linear.default
    row = torch.ops.torch_tp.row_parallel_linear.default
    for op, args in [
        (col, (x, w_col, b_col, group)),
        (col, (x, w_col, None, group)),
        (col, (x_shard, w_col, b_col, group, 1, 3 * world_size, "gelu_tanh")),
        (row, (x, w_row, b_row, group)),
        (row, (x, w_row, b_row, group, 1)),
    ]:
        torch.library.opcheck(op, args)
    # The backward ops with every output_mask: the Meta kernels' empty
    # tensors for the gradients not asked for agree with the device kernels'.
    col_backward = torch.ops.torch_tp._column_parallel_linear_backward.default
    row_backward = torch.ops.torch_tp._row_parallel_linear_backward.default
    grad_col, grad_row = _full((2, 3 * world_size, 6), 6, torch.float64), _full((2, 3 * world_size, 5), 7, torch.float64)
    x, x_shard, w_col, w_row = x.detach(), x_shard.detach(), w_col.detach(), w_row.detach()
    no_pre = torch.empty(0, dtype=torch.float64)
    grad_row_shard = ops.shard(grad_row, 1)
    for mask in itertools.product([False, True], repeat=3):
        mask = list(mask)
        torch.library.opcheck(col_backward, (grad_col, x, w_col, no_pre, group, None, None, "none", False, mask))
        torch.library.opcheck(col_backward, (grad_col, x_shard, w_col, no_pre, group, 1, 3 * world_size, "none",
                                             False, mask))
        torch.library.opcheck(row_backward, (grad_row, x, w_row, group, None, mask))
        torch.library.opcheck(row_backward, (grad_row_shard, x, w_row, group, 1, mask))


@pytest.mark.parametrize("world_size", [1, 2])
def test_linear_opcheck(ranks, world_size):
    ranks(world_size).run(_check_linear_opcheck, timeout=300)


# ---------------------------------------------------------------- embedding


def _check_vocab_parallel_embedding(dtype, vocab, dim, padding_idx, sequence_parallel):
    seq = 7
    weight = _full((vocab, dim), 11, dtype)
    gen = torch.Generator().manual_seed(12)
    ids = torch.randint(0, vocab, (3, seq), generator=gen)
    if padding_idx is not None:
        ids[0, :3] = padding_idx % vocab
    grad = _full((3, seq, dim), 13, dtype)

    ref_w = _param(weight)
    ref = F.embedding(ids, ref_w, padding_idx)
    ref.backward(grad)

    w_r = _param(ops.shard(weight, 0))
    out = torch.ops.torch_tp.vocab_parallel_embedding(
        ids, w_r, _group(), vocab, padding_idx, 1 if sequence_parallel else None)
    assert_close(out, ops.shard(ref, 1) if sequence_parallel else ref, "output", TOL[dtype])
    out.backward(ops.shard(grad, 1) if sequence_parallel else grad)
    assert_close(w_r.grad, ops.shard(ref_w.grad, 0), "grad_weight", TOL[dtype])  # empty on a rank that owns no rows
    if padding_idx is not None:
        assert ref_w.grad[padding_idx].abs().sum() == 0


def _check_column_parallel_embedding(dtype, vocab, dim, padding_idx, gather):
    seq = 7
    weight = _full((vocab, dim), 21, dtype)
    gen = torch.Generator().manual_seed(22)
    ids = torch.randint(0, vocab, (3, seq), generator=gen)
    grad = _full((3, seq, dim), 23, dtype)

    ref_w = _param(weight)
    ref = F.embedding(ids, ref_w, padding_idx)
    ref.backward(grad)

    w_r = _param(ops.shard(weight, 1))
    my_ids = ops.shard(ids, 1) if gather else ids
    out = torch.ops.torch_tp.column_parallel_embedding(
        my_ids, w_r, _group(), padding_idx, 1 if gather else None, seq if gather else None)
    assert_close(out, ops.shard(ref, -1), "output", TOL[dtype])
    out.backward(ops.shard(grad, -1))
    assert_close(w_r.grad, ops.shard(ref_w.grad, 1), "grad_weight", TOL[dtype])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_vocab_parallel_embedding(ranks, world_size):
    pool = ranks(world_size)
    for sequence_parallel in [False, True]:
        pool.run(_check_vocab_parallel_embedding, torch.float32, 12, 8, None, sequence_parallel)
        pool.run(_check_vocab_parallel_embedding, torch.float32, 11, 8, 5, sequence_parallel)  # uneven
        pool.run(_check_vocab_parallel_embedding, torch.float64, 10, 4, -1, sequence_parallel)
    pool.run(_check_vocab_parallel_embedding, torch.bfloat16, 11, 8, 0, False)
    pool.run(_check_vocab_parallel_embedding, torch.float32, 3, 4, None, False)  # ranks with no rows at p = 4


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_column_parallel_embedding(ranks, world_size):
    pool = ranks(world_size)
    for gather in [False, True]:
        pool.run(_check_column_parallel_embedding, torch.float32, 12, 8, None, gather)
        pool.run(_check_column_parallel_embedding, torch.float64, 9, 10, 2, gather)  # 10 columns: uneven at 3, 4


def _check_embedding_opcheck():
    group = _group()
    world_size = dist.get_world_size()
    vocab = 10
    ids = torch.randint(0, vocab, (2, 2 * world_size), generator=torch.Generator().manual_seed(0))
    w_vocab = _full((vocab, 6), 1, torch.float64)
    w_vocab = ops.shard(w_vocab, 0).requires_grad_()
    w_col = ops.shard(_full((vocab, 6), 2, torch.float64), 1).requires_grad_()
    torch.library.opcheck(torch.ops.torch_tp.vocab_parallel_embedding.default, (ids, w_vocab, group, vocab, 3, 1))
    torch.library.opcheck(torch.ops.torch_tp.column_parallel_embedding.default, (ids, w_col, group, None))


@pytest.mark.parametrize("world_size", [1, 2])
def test_embedding_opcheck(ranks, world_size):
    ranks(world_size).run(_check_embedding_opcheck, timeout=300)


def _composed_shard_lookup(ids, weight, start, padding_idx):
    """The ATen composition that vocab_parallel_embedding's fused lookup replaces on the CPU."""
    owned = (ids >= start) & (ids < start + weight.size(0))
    local = (ids - start).masked_fill(~owned, 0)
    return torch.where(owned.unsqueeze(-1), F.embedding(local, weight, padding_idx), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_vocab_shard_lookup_matches_composition(dtype):
    """The fused CPU lookup and its table gradient give the composition's numbers bit for bit (NOTE [the vocab
    shard's lookup]): rows copied or zeroed forward, and backward each owned row summed in the order of the ids
    and rounded as embedding's backward rounds, which shows in bfloat16 and float16, where every add rounds.
    Ids repeat (a third of 300 onto one row) so that the order matters; padding rows, int32 ids, tables with
    a row stride, and an element stride, of their own, and two threads over a 2500-row shard are covered. (The
    op's path through autograd is test_vocab_parallel_embedding's, against F.embedding.)"""
    vocab, rows, dim = 40, 8, 19
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(rows, 2 * dim, generator=gen, dtype=torch.float64).to(dtype)
    tables = {"contiguous": wide[:, :dim].contiguous(), "row stride": wide[:, :dim], "element stride": wide[:, ::2]}
    cases = [(16, None, torch.int64, "contiguous"), (0, 3, torch.int32, "row stride"),
             (32, 7, torch.int64, "element stride"), (35, None, torch.int64, "row stride")]
    for start, padding_idx, index_dtype, layout in cases:
        weight = tables[layout]
        ids = torch.randint(0, vocab, (6, 50), generator=gen).to(index_dtype)
        ids[ids % 3 == 0] = start + 2
        if padding_idx is not None:
            ids[0, :5] = start + padding_idx
        grad = torch.randn(*ids.shape, weight.size(1), generator=gen, dtype=torch.float64).to(dtype)
        ref_w = _param(weight)
        ref = _composed_shard_lookup(ids, ref_w, start, padding_idx)
        ref.backward(grad)
        case = (start, padding_idx, index_dtype, layout)
        out = torch.ops.torch_tp._vocab_shard_lookup(ids, weight, start, vocab)
        assert torch.equal(out, ref.detach()), case
        grad_weight = torch.ops.torch_tp._vocab_shard_lookup_backward(
            grad, ids, start, rows, -1 if padding_idx is None else padding_idx)
        assert torch.equal(grad_weight, ref_w.grad), case
        assert grad_weight.abs().sum() > 0, case
    # Threads split the ids forward and the table's rows backward (1000 a task): a shard of 2500 rows.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        weight = torch.randn(2500, 8, generator=gen, dtype=torch.float64).to(dtype)
        ids = torch.randint(0, 6000, (4000,), generator=gen)
        ids[::7] = 2100  # one row summed from many ids
        grad = torch.randn(4000, 8, generator=gen, dtype=torch.float64).to(dtype)
        ref_w = _param(weight)
        ref = _composed_shard_lookup(ids, ref_w, 2000, None)
        ref.backward(grad)
        assert torch.equal(torch.ops.torch_tp._vocab_shard_lookup(ids, weight, 2000, 6000), ref.detach())
        assert torch.equal(torch.ops.torch_tp._vocab_shard_lookup_backward(grad, ids, 2000, 2500, -1), ref_w.grad)
    finally:
        torch.set_num_threads(threads)
    # A direct call of the backward piece with a gradient of another shape is refused, not read past its end.
    with pytest.raises(RuntimeError, match=r"_vocab_shard_lookup_backward: grad has shape \[3, 8\], but ids has "
                                           r"shape \[4\]"):
        torch.ops.torch_tp._vocab_shard_lookup_backward(
            torch.zeros(3, 8, dtype=dtype), torch.zeros(4, dtype=torch.long), 0, 5, -1)


# ---------------------------------------------------------------- errors


def _check_errors():
    group = _group()
    world_size = dist.get_world_size()
    col = torch.ops.torch_tp.column_parallel_linear
    row = torch.ops.torch_tp.row_parallel_linear
    x = torch.randn(2, 4, 8)
    w = torch.randn(6, 8)
    cases = [
        (lambda: col(x, torch.randn(6, 7), None, group),
         ["torch_tp::column_parallel_linear", "x.size(-1)=8", "weight.size(1)=7"]),
        (lambda: col(x, w, torch.randn(5), group), ["torch_tp::column_parallel_linear", "bias must have shape [6]", "[5]"]),
        (lambda: col(x, w, None, group, 3), ["torch_tp::column_parallel_linear", "gather_dim=3", "out of range"]),
        (lambda: col(x, w, None, group, -1), ["torch_tp::column_parallel_linear", "gather_dim=-1", "feature dimension"]),
        (lambda: col(x, w.double(), None, group), ["torch_tp::column_parallel_linear", "weight has dtype Double", "Float"]),
        (lambda: col(x, w, w[:, 0].half(), group), ["torch_tp::column_parallel_linear", "bias has dtype Half"]),
        (lambda: col(x, w, None, group, None, None, "relu"), ["torch_tp::column_parallel_linear", "activation='relu'"]),
        (lambda: col(x, w.t(), None, group), ["torch_tp::column_parallel_linear", "x.size(-1)=8", "weight.size(1)=6"]),
        (lambda: col(x, w, None, "nope"), ["torch_tp::column_parallel_linear", "group_name='nope'"]),
        (lambda: col(x.long(), w.long(), None, group), ["torch_tp::column_parallel_linear", "x has dtype Long"]),
        (lambda: row(x, torch.randn(5, 3), None, group), ["torch_tp::row_parallel_linear", "x.size(-1)=8", "weight.size(1)=3"]),
        (lambda: row(x, w, torch.randn(8), group), ["torch_tp::row_parallel_linear", "bias must have shape [6]"]),
        (lambda: row(x, w, None, group, -4), ["torch_tp::row_parallel_linear", "scatter_dim=-4"]),
        (lambda: row(x, w, None, group, 2), ["torch_tp::row_parallel_linear", "scatter_dim=2", "feature dimension"]),
        # None where a tensor is required: named before autograd describes the inputs.
        (lambda: ops.column_parallel_linear(x, None, None, group), ["torch_tp::column_parallel_linear", "weight", "None"]),
        (lambda: ops.column_parallel_linear(None, w, None, group), ["torch_tp::column_parallel_linear", "x", "None"]),
        (lambda: ops.row_parallel_linear(x, None, None, group), ["torch_tp::row_parallel_linear", "weight", "None"]),
    ]
    emb = torch.ops.torch_tp.vocab_parallel_embedding
    ids = torch.randint(0, 10, (2, 3))
    rows = ops.chunk_range(10, world_size, dist.get_rank())[1]
    cases += [
        (lambda: emb(ids, torch.randn(rows + 1, 4), group, 10),
         ["torch_tp::vocab_parallel_embedding", f"weight.size(0)={rows + 1}", "vocab_size=10", f"has {rows} rows"]),
        (lambda: emb(ids, torch.randn(rows, 4), group, 10, 10), ["torch_tp::vocab_parallel_embedding", "padding_idx=10"]),
        (lambda: emb(ids.float(), torch.randn(rows, 4), group, 10), ["torch_tp::vocab_parallel_embedding", "ids has dtype Float"]),
        (lambda: emb(ids, torch.randn(rows, 4), group, 10, None, 2),
         ["torch_tp::vocab_parallel_embedding", "scatter_dim=2", "embedding dimension"]),
        (lambda: torch.ops.torch_tp.column_parallel_embedding(ids, torch.randn(10, 4), group, None, 5),
         ["torch_tp::column_parallel_embedding", "gather_dim=5"]),
        (lambda: emb(ids, None, group, 10), ["torch_tp::vocab_parallel_embedding", "weight", "None"]),
    ]
    if world_size > 1:
        cases.append((lambda: col(torch.randn(2, 3, 8), w, None, group, 1, 10),
                      ["torch_tp::column_parallel_linear", "x.size(1)=3", "full_size=10"]))
    for call, fragments in cases:
        assert_error_names(call, fragments)
    # The Meta kernels check the same way.
    with pytest.raises(RuntimeError, match="weight.size.1.=7"):
        col(x.to("meta"), torch.randn(6, 7, device="meta"), None, group)


@pytest.mark.parametrize("world_size", [1, 2])
def test_errors(ranks, world_size):
    ranks(world_size).run(_check_errors)


def _check_typed_wrappers():
    """torch_tp.ops' layer wrappers route every argument to its place in the op: each call
    equals, bitwise, the raw op called with the same arguments by name, in output and in
    the input's gradient (which partial_grad_input changes), for a ProcessGroup and a name."""
    tp = dist.group.WORLD
    raw = torch.ops.torch_tp
    seq, dim, features, vocab = 5, 6, 8, 11
    x = _full((2, seq, dim), 1, torch.float64)
    h_piece = ops.shard(_full((2, seq, features), 8, torch.float64), 2)  # a column layer's output
    w_col = ops.shard(_full((features, dim), 2, torch.float64), 0)
    b_col = ops.shard(_full((features,), 3, torch.float64), 0)
    w_row = ops.shard(_full((dim, features), 4, torch.float64), 1)
    b_row = _full((dim,), 5, torch.float64)
    table = _full((vocab, dim), 6, torch.float64)
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(7))

    def output_and_grad(op, x_in, *args, **kwargs):
        x_in = _param(x_in)
        y = op(x_in, *args, **kwargs)
        y.sum().backward()
        return y, x_in.grad

    for group in (tp, tp.group_name):
        pairs = [
            (output_and_grad(ops.column_parallel_linear, ops.shard(x, 1), w_col, b_col, group, gather_dim=1,
                             full_size=seq, activation="gelu_tanh"),
             output_and_grad(raw.column_parallel_linear, ops.shard(x, 1), w_col, b_col, tp.group_name,
                             gather_dim=1, full_size=seq, activation="gelu_tanh")),
            (output_and_grad(ops.column_parallel_linear, x, w_col, None, group, partial_grad_input=True),
             output_and_grad(raw.column_parallel_linear, x, w_col, None, tp.group_name, partial_grad_input=True)),
            (output_and_grad(ops.row_parallel_linear, h_piece, w_row, b_row, group, scatter_dim=1),
             output_and_grad(raw.row_parallel_linear, h_piece, w_row, b_row, tp.group_name, scatter_dim=1)),
        ]
        for (y, grad), (y_raw, grad_raw) in pairs:
            assert torch.equal(y, y_raw) and torch.equal(grad, grad_raw)
        assert torch.equal(
            ops.vocab_parallel_embedding(ids, ops.shard(table, 0), vocab, group, padding_idx=0, scatter_dim=1),
            raw.vocab_parallel_embedding(ids, ops.shard(table, 0), tp.group_name, vocab, padding_idx=0,
                                         scatter_dim=1))
        assert torch.equal(
            ops.column_parallel_embedding(ops.shard(ids, 1), ops.shard(table, 1), group, padding_idx=0,
                                          gather_dim=1, full_size=seq),
            raw.column_parallel_embedding(ops.shard(ids, 1), ops.shard(table, 1), tp.group_name, padding_idx=0,
                                          gather_dim=1, full_size=seq))


def test_typed_wrappers(ranks):
    ranks(3).run(_check_typed_wrappers)


# ---------------------------------------------------------------- CUDA (run where a GPU is present)
#
# The CUDA forward fuses the bias (and GELU) into a cuBLASLt epilogue and
# falls back to ATen's unfused GEMMs where cuBLASLt does not take the problem
# (NOTE [cuBLASLt or ATen] in csrc/ops/linear_cuda.cpp). These checks run on
# gloo ranks that share the GPUs (gloo moves CUDA tensors; NCCL needs a GPU per
# rank), so 2 and 3 ranks run on one GPU. References are computed on the same
# device from contiguous, freshly allocated copies, so torch's own GEMM sees
# none of the layouts under test.
#
# Tolerances, relative to the reference's largest magnitude as TOL's:
#   float32  1e-5 with TF32 off (every check turns it off unless it is the
#            subject), as on the CPU.
#   float16  1e-2: 11-bit significands (2^-11 = 4.9e-4 per rounding); the
#            fused epilogue rounds once where F.gelu(F.linear()) rounds twice,
#            and a row-parallel output adds up to two more roundings at 3 ranks.
#   bfloat16 3e-2: as TOL's.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
CUDA_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _restoring_matmul_settings(fn, *args):
    """Runs ``fn(*args)`` on this rank's GPU (rank r on cuda:r % count) and
    puts torch.backends.cuda.matmul's settings back as they were, whatever fn
    changed: the ranks are processes that outlive the test."""
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_tf32, matmul.allow_fp16_accumulation,
             (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction_split_k),
             (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction_split_k))
    try:
        matmul.allow_tf32 = False
        return fn(*args)
    finally:
        (matmul.allow_tf32, matmul.allow_fp16_accumulation, matmul.allow_fp16_reduced_precision_reduction,
         matmul.allow_bf16_reduced_precision_reduction) = saved


@pytest.fixture
def cuda_ranks(ranks):
    """``cuda_ranks(world_size, fn, *args, backend="gloo")``: ``fn(*args)`` on
    every rank, each on its GPU, with TF32 off and the matmul settings restored
    afterwards (see _restoring_matmul_settings)."""
    def run(world_size, fn, *args, backend="gloo"):
        return ranks(world_size, backend).run(_restoring_matmul_settings, fn, *args, timeout=300)
    return run


def _cuda_full(shape, seed, dtype):
    return _full(shape, seed, dtype).cuda()


def _check_cuda_column_on(x, w, b, activation, what, w_full=None, b_full=None):
    """column_parallel_linear(x, w, b) (w, b: this rank's shards, in whatever
    layout the caller made) against F.linear on aligned contiguous copies of
    the full weights, forward and backward; returns nothing, raises on a mismatch."""
    w_full = w if w_full is None else w_full
    b_full = b if b_full is None else b_full
    group = _group()
    ref_x, ref_w = _param(x.contiguous()), _param(w_full.contiguous())
    ref_b = None if b_full is None else _param(b_full.contiguous())
    ref = F.linear(ref_x, ref_w, ref_b)
    if activation == "gelu_tanh":
        ref = F.gelu(ref, approximate="tanh")
    grad = _cuda_full(tuple(ref.shape), 9, ref.dtype)
    ref.backward(grad)

    # detach() keeps the storage offset, so the op sees the caller's pointers.
    x_r, w_r = x.detach().requires_grad_(), w.detach().requires_grad_()
    b_r = None if b is None else b.detach().requires_grad_()
    y = torch.ops.torch_tp.column_parallel_linear(x_r, w_r, b_r, group, None, None, activation)
    tol = CUDA_TOL[ref.dtype]
    assert_close(y, ops.shard(ref.detach(), -1), f"{what}: output", tol)
    grads = torch.autograd.grad(y, [x_r, w_r] + ([] if b is None else [b_r]), ops.shard(grad, -1))
    assert_close(grads[0], ref_x.grad, f"{what}: grad_x", tol)
    assert_close(grads[1], ops.shard(ref_w.grad, 0), f"{what}: grad_weight", tol)
    if b is not None:
        assert_close(grads[2], ops.shard(ref_b.grad, 0), f"{what}: grad_bias", tol)


def _check_cuda_row_on(x, w, b, what, x_full, w_full):
    """row_parallel_linear(x, w, b) (x, w: this rank's shards) against F.linear
    of the full tensors, forward and backward."""
    ref_x, ref_w, ref_b = _param(x_full.contiguous()), _param(w_full.contiguous()), _param(b.contiguous())
    ref = F.linear(ref_x, ref_w, ref_b)
    grad = _cuda_full(tuple(ref.shape), 9, ref.dtype)
    ref.backward(grad)
    inputs = [t.detach().requires_grad_() for t in (x, w, b)]
    y = torch.ops.torch_tp.row_parallel_linear(*inputs, _group())
    tol = CUDA_TOL[ref.dtype]
    assert_close(y, ref.detach(), f"{what}: output", tol)
    grads = torch.autograd.grad(y, inputs, grad)
    assert_close(grads[0], ops.shard(ref_x.grad, -1), f"{what}: grad_x", tol)
    assert_close(grads[1], ops.shard(ref_w.grad, 1), f"{what}: grad_weight", tol)
    assert_close(grads[2], ref_b.grad, f"{what}: grad_bias", tol)


def _check_cuda_linear():
    """Contiguous, aligned inputs: the fused epilogues (bias, bias + GELU,
    GELU alone), the ATen paths (no bias and no activation, float64, GELU over
    a shard of N % 8 != 0 features) and the row-parallel op, against F.linear."""
    for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.float64]:
        for activation in ["none", "gelu_tanh"]:
            for out_features in [64, 36]:  # 36 (9 per rank at 4) is not a multiple of 8: no fused GELU aux
                x = _cuda_full((4, 16, 32), 1, dtype)
                w = _cuda_full((out_features, 32), 2, dtype)
                b = _cuda_full((out_features,), 3, dtype)
                what = f"{dtype} {activation} N={out_features}"
                _check_cuda_column_on(x, ops.shard(w, 0), ops.shard(b, 0), activation, what, w, b)
                _check_cuda_column_on(x, ops.shard(w, 0), None, activation, f"{what} no bias", w, None)
                h = _cuda_full((4, 16, out_features), 5, dtype)
                w2 = _cuda_full((32, out_features), 6, dtype)
                _check_cuda_row_on(ops.shard(h, -1), ops.shard(w2, 1), _cuda_full((32,), 7, dtype),
                                   f"{what} row", h, w2)


@needs_cuda
def test_cuda_linear_nccl(cuda_ranks):
    cuda_ranks(1, _check_cuda_linear, backend="cpu:gloo,cuda:nccl")


@needs_cuda
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_linear_gloo(cuda_ranks, world_size):
    cuda_ranks(world_size, _check_cuda_linear)


def _alignment(t):
    """The largest power of two, up to 256, dividing t's data pointer (what
    linear_cuda.cpp tells cuBLASLt)."""
    address, alignment = t.data_ptr(), 256
    while address % alignment:
        alignment //= 2
    return alignment


def _offset_copy(t, offset):
    """t's values in a tensor that starts `offset` elements into a fresh
    buffer: the caching allocator's blocks are 512-byte aligned, so its data
    pointer is aligned to offset * element_size bytes and no more (for the
    offsets used here)."""
    buffer = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    copy = buffer[offset:].view(t.shape).copy_(t)
    assert _alignment(copy) == offset * t.element_size(), "the test's own premise"
    return copy


def _check_cuda_offsets():
    """Inputs at storage offsets that leave their data pointers 2-, 4- or
    8-byte aligned (cuBLASLt assumes 256 unless told): x, the weight shard and
    the bias shard in turn, then all three; and x[1:] of a tensor with an odd
    number of features, whose rows are all misaligned. Without the alignment
    preferences, cuBLASLt picks kernels these pointers break (a misaligned
    address, or CUBLAS_STATUS_NOT_SUPPORTED from the matmul)."""
    for dtype, offsets in [(torch.float16, [1, 2, 4]), (torch.bfloat16, [1, 2, 4]), (torch.float32, [1, 2])]:
        x, w, b = _cuda_full((2, 8, 32), 1, dtype), _cuda_full((64, 32), 2, dtype), _cuda_full((64,), 3, dtype)
        w_r, b_r = ops.shard(w, 0), ops.shard(b, 0)
        for offset in offsets:
            for activation in ["none", "gelu_tanh"]:
                what = f"{dtype} offset {offset} {activation}"
                _check_cuda_column_on(_offset_copy(x, offset), w_r, b_r, activation, f"{what} x", w, b)
                _check_cuda_column_on(x, _offset_copy(w_r, offset), b_r, activation, f"{what} weight", w, b)
                _check_cuda_column_on(x, w_r, _offset_copy(b_r, offset), activation, f"{what} bias", w, b)
                _check_cuda_column_on(_offset_copy(x, offset), _offset_copy(w_r, offset), _offset_copy(b_r, offset),
                                      activation, f"{what} all", w, b)
        x_odd = _cuda_full((17, 33), 4, dtype)[1:]  # 33 features: x[1:] and every row start misaligned
        w_odd = _cuda_full((64, 33), 5, dtype)
        _check_cuda_column_on(x_odd, ops.shard(w_odd, 0), b_r, "gelu_tanh", f"{dtype} x[1:], K=33", w_odd, b)


def _check_cuda_non_contiguous():
    """Non-contiguous inputs: x transposed in memory, x a column slice (rows
    2K apart), a transposed weight shard, a strided bias; and the row op with
    a transposed x and weight."""
    for dtype in [torch.float32, torch.bfloat16, torch.float16]:
        w, b = _cuda_full((64, 32), 2, dtype), _cuda_full((64,), 3, dtype)
        w_r, b_r = ops.shard(w, 0), ops.shard(b, 0)
        x_t = _cuda_full((2, 32, 8), 1, dtype).transpose(1, 2)  # [2, 8, 32], features stride 8
        x_slice = _cuda_full((2, 8, 64), 1, dtype)[..., :32]   # rows 64 elements apart
        w_t = w_r.t().contiguous().t()                          # [N/p, 32], stride (1, N/p)
        b_strided = torch.stack([b_r, b_r], 1)[:, 0]            # stride 2
        assert not any(t.is_contiguous() for t in (x_t, x_slice, w_t, b_strided)), "the test's own premise"
        for activation in ["none", "gelu_tanh"]:
            what = f"{dtype} {activation}"
            _check_cuda_column_on(x_t, w_r, b_r, activation, f"{what} x transposed", w, b)
            _check_cuda_column_on(x_slice, w_r, b_r, activation, f"{what} x sliced", w, b)
            _check_cuda_column_on(x_t, w_t, b_strided, activation, f"{what} all strided", w, b)
        h = _cuda_full((2, 64, 8), 5, dtype).transpose(1, 2)  # [2, 8, 64]
        w2 = _cuda_full((64, 32), 6, dtype).t()               # [32, 64]
        _check_cuda_row_on(ops.shard(h, -1).transpose(1, 2).contiguous().transpose(1, 2),
                           ops.shard(w2, 1).t().contiguous().t(), _cuda_full((32,), 7, dtype),
                           f"{dtype} row strided", h, w2)


@needs_cuda
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_offset_and_non_contiguous_inputs(cuda_ranks, world_size):
    cuda_ranks(world_size, _check_cuda_offsets)
    cuda_ranks(world_size, _check_cuda_non_contiguous)


def _check_cuda_empty_shards():
    """Empty pieces: N = 2 features over 3 ranks (rank 2 holds a [0, K] weight
    and a [0] bias), K = 2 row-parallel features over 3 ranks (rank 2 holds
    x [.., 0] and a [N, 0] weight), and x with no rows on every rank."""
    for dtype in [torch.float32, torch.bfloat16, torch.float16]:
        x = _cuda_full((2, 4, 16), 1, dtype)
        w, b = _cuda_full((2, 16), 2, dtype), _cuda_full((2,), 3, dtype)
        for activation in ["none", "gelu_tanh"]:
            _check_cuda_column_on(x, ops.shard(w, 0), ops.shard(b, 0), activation, f"{dtype} {activation} N=2", w, b)
            w8, b8 = _cuda_full((8, 16), 2, dtype), _cuda_full((8,), 3, dtype)
            _check_cuda_column_on(x[:, :0], ops.shard(w8, 0), ops.shard(b8, 0), activation,
                                  f"{dtype} {activation} no rows", w8, b8)
        h, w2 = _cuda_full((2, 4, 2), 5, dtype), _cuda_full((16, 2), 6, dtype)
        _check_cuda_row_on(ops.shard(h, -1), ops.shard(w2, 1), _cuda_full((16,), 7, dtype), f"{dtype} row K=2", h, w2)


@needs_cuda
def test_cuda_empty_shards(cuda_ranks):
    cuda_ranks(3, _check_cuda_empty_shards)


def _check_cuda_no_reduced_precision_reduction(split_k):
    """float16 with reduced-precision reductions off: torch's own check
    (test_cublas_addmm_no_reduced_precision in test/test_matmul_cuda.py) on
    the fused bias epilogue. Each output sums 16384 products of +65504 and
    16384 of -65504: split-K partial sums stored in float16 overflow to inf
    (and inf - inf is nan), float32 ones (or no split-K) stay finite. torch
    saw cuBLASLt pick a float16 (OUTPUT_TYPE) reduction for these shapes on
    H200 (4 rows) and A100 (8 rows) when allowed to."""
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, split_k)
    k = 32768
    for rows in [4, 8]:
        x = torch.full((rows, k), 65504.0, dtype=torch.float16, device="cuda")
        w = torch.ones((rows, k), dtype=torch.float16, device="cuda")
        w[:, k // 2:] = -1.0
        y = torch.ops.torch_tp.column_parallel_linear(x, w, torch.zeros(rows, dtype=torch.float16, device="cuda"),
                                                      _group())
        assert torch.isfinite(y).all(), f"{rows} rows, split_k={split_k}: a float16 reduction overflowed: {y}"


def _check_cuda_tf32():
    """float32 follows torch.backends.cuda.matmul.allow_tf32: with it off the
    fused GEMM meets float32's tolerance against float64 (about 1e-7 here);
    with it on, the inputs are rounded to TF32's 10-bit significands (2^-11
    relative each), which leaves an error near 4e-4 of the scale for K = 1024
    standard normal terms: the check asks for 100 times float32's error."""
    x64, w64, b64 = _cuda_full((64, 1024), 1, torch.float64), _cuda_full((64, 1024), 2, torch.float64), \
        _cuda_full((64,), 3, torch.float64)
    exact = F.linear(x64, w64, b64)
    x, w, b = x64.float(), w64.float(), b64.float()
    errors = {}
    for tf32 in [False, True]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        y = torch.ops.torch_tp.column_parallel_linear(x, w, b, _group())
        errors[tf32] = ((y.double() - exact).abs().max() / exact.abs().max()).item()
    assert errors[False] <= CUDA_TOL[torch.float32], f"TF32 off: error {errors[False]:.2e}"
    assert errors[True] > 100 * errors[False], f"TF32 on: error {errors[True]:.2e}; was TF32 ignored?"


def _check_cuda_fp16_accumulation():
    """allow_fp16_accumulation: torch then accumulates float16 GEMMs in float16,
    which the fused path does not reproduce, so ATen computes it, with the very
    calls F.linear and F.gelu make (addmm(b, x, w.t()), gelu): bitwise equal.
    A float32-accumulating fused GEMM would differ in some of the 1024 outputs."""
    torch.backends.cuda.matmul.allow_fp16_accumulation = True
    x, w, b = _cuda_full((16, 32), 1, torch.float16), _cuda_full((64, 32), 2, torch.float16), \
        _cuda_full((64,), 3, torch.float16)
    y = torch.ops.torch_tp.column_parallel_linear(x, w, b, _group(), activation="gelu_tanh")
    assert torch.equal(y, F.gelu(F.linear(x, w, b), approximate="tanh")), "allow_fp16_accumulation not honoured"


@needs_cuda
def test_cuda_matmul_settings(cuda_ranks):
    for split_k in [True, False]:
        cuda_ranks(1, _check_cuda_no_reduced_precision_reduction, split_k)
    if torch.cuda.get_device_capability() >= (8, 0):  # TF32 needs Ampere or later
        cuda_ranks(1, _check_cuda_tf32)
    cuda_ranks(1, _check_cuda_fp16_accumulation)


def _read_matmul_settings():
    matmul = torch.backends.cuda.matmul
    return (matmul.allow_tf32, matmul.allow_fp16_accumulation, matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction_split_k)


def _change_matmul_settings():
    torch.backends.cuda.matmul.allow_fp16_accumulation = True
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)


@needs_cuda
def test_cuda_matmul_settings_are_restored(cuda_ranks, ranks):
    before = ranks(1, "gloo").run(_read_matmul_settings)
    cuda_ranks(1, _change_matmul_settings)
    assert ranks(1, "gloo").run(_read_matmul_settings) == before


# ---------------------------------------------------------------- double backward


def _check_column_gelu_double_backward():
    """The reported case: d/dx of sum(d/dx sum(y^2)) through a column-parallel
    linear with GELU, against F.gelu(F.linear(x, w), approximate="tanh")."""
    world_size = dist.get_world_size()
    x = _full((3, 4), 1, torch.float64)
    w = _full((2 * world_size, 4), 2, torch.float64)
    ref_x, ref_w = _param(x), _param(w)
    ref_y = F.gelu(F.linear(ref_x, ref_w), approximate="tanh")
    (ref_gx,) = torch.autograd.grad((ref_y ** 2).sum(), ref_x, create_graph=True)
    ref_gx.sum().backward()

    x_r, w_r = _param(x), _param(ops.shard(w, 0))
    y = torch.ops.torch_tp.column_parallel_linear(x_r, w_r, None, _group(), None, None, "gelu_tanh")
    (gx,) = torch.autograd.grad((y ** 2).sum(), x_r, create_graph=True)
    assert_close(gx, ref_gx, "first-order grad_x", TOL[torch.float64])
    gx.sum().backward()
    assert_close(x_r.grad, ref_x.grad, "second-order x.grad", TOL[torch.float64])
    assert_close(w_r.grad, ops.shard(ref_w.grad, 0), "second-order w.grad", TOL[torch.float64])


@pytest.mark.parametrize("world_size", [1, 2])
def test_column_gelu_double_backward(ranks, world_size):
    ranks(world_size).run(_check_column_gelu_double_backward)


def _check_layer_gradgrad(layer, bias, dim, activation="none", partial_grad_input=False):
    """gradcheck and gradgradcheck over all ranks (tp_gradcheck.py) of one
    sharded layer: global x, weight, bias in; the global output out."""
    from tp_gradcheck import check_grad_and_gradgrad, seeded, shard_in, stack_out

    p = dist.get_world_size()
    name = _group()
    if layer == "column":
        X, W, B = seeded((2, 2 * p, 3), 1), seeded((2 * p, 3), 2), seeded((2 * p,), 3)

        def fn(X, W, B):
            # A partial grad_x is summed over ranks by f, as the styles' DTensor
            # gather does (NOTE [partial grad_x] in linear.cpp).
            if dim is not None:
                x = shard_in(X, dim)
            else:
                x = torch.ops.torch_tp.copy_to_tp_region(X, name) if partial_grad_input else X
            b = shard_in(B, 0) if bias else None
            y = torch.ops.torch_tp.column_parallel_linear(x, shard_in(W, 0), b, name, dim, None, activation,
                                                          partial_grad_input)
            return stack_out(y)
    elif layer == "row":
        X, W, B = seeded((2, 2 * p, 2 * p), 1), seeded((3, 2 * p), 2), seeded((3,), 3)

        def fn(X, W, B):
            y = torch.ops.torch_tp.row_parallel_linear(shard_in(X, -1), shard_in(W, 1), B if bias else None, name, dim)
            return stack_out(y) if dim is not None else y
    elif layer == "vocab_embedding":
        ids = torch.arange(4 * p).reshape(2, 2 * p).flip(1) % (2 * p)  # every id, every owner
        X, W = ids, seeded((2 * p, 3), 2)

        def fn(ids, W):
            y = torch.ops.torch_tp.vocab_parallel_embedding(ids, shard_in(W, 0), name, 2 * p, None, dim)
            return stack_out(y) if dim is not None else y
    else:
        ids = torch.tensor([[0, 3, 1, 4], [2, 1, 0, 4]])
        X, W = ids, seeded((5, 2 * p), 2)

        def fn(ids, W):
            x = ops.shard(ids, dim) if dim is not None else ids
            y = torch.ops.torch_tp.column_parallel_embedding(x, shard_in(W, 1), name, None, dim, None)
            return stack_out(y)
    inputs = (X, W, B) if layer in ("column", "row") else (X, W)
    return check_grad_and_gradgrad(fn, inputs)


@pytest.mark.parametrize("world_size", [1, 2])
def test_layers_double_backward(ranks, world_size):
    """The linear ops' backward used to be a non-differentiable op, so a
    backward with create_graph=True returned wrong second derivatives (for
    every activation, with and without gather/scatter dims). Every op's
    first and second derivatives are now checked against finite differences."""
    pool = ranks(world_size)
    for bias in [False, True]:
        for activation in ["none", "gelu_tanh"]:
            for dim in [None, 1]:
                pool.run(_check_layer_gradgrad, "column", bias, dim, activation)
            pool.run(_check_layer_gradgrad, "column", bias, None, activation, True)
        for dim in [None, 1]:
            pool.run(_check_layer_gradgrad, "row", bias, dim)
    for dim in [None, 1]:
        pool.run(_check_layer_gradgrad, "vocab_embedding", False, dim)
    for dim in [None, 1]:
        pool.run(_check_layer_gradgrad, "column_embedding", False, dim)


# ---------------------------------------------------------------- ids out of range


def _check_embedding_ids_out_of_range():
    """An id outside [0, num_embeddings) raises as F.embedding does, naming the
    op and the id, on every rank (vocab_parallel_embedding returned zero rows)."""
    p = dist.get_world_size()
    name = _group()
    vocab = 6
    table = _full((vocab, 4), 1, torch.float64)
    rows, cols = ops.shard(table, 0), ops.shard(table, 1)
    for bad in [-1, vocab, vocab + 5, -(2 ** 63), 2 ** 63 - 1]:
        ids = torch.tensor([[0, 1, bad], [2, 3, 4]])
        with pytest.raises(IndexError):
            F.embedding(ids, table)  # torch's own rule, for comparison
        for scatter_dim in [None, 0]:
            with pytest.raises(IndexError, match=rf"torch_tp::vocab_parallel_embedding: ids contains {bad}, "
                                                 rf"outside \[0, {vocab}\)"):
                torch.ops.torch_tp.vocab_parallel_embedding(ids, rows, name, vocab, None, scatter_dim)
        with pytest.raises(IndexError, match=rf"torch_tp::column_parallel_embedding: ids contains {bad}"):
            torch.ops.torch_tp.column_parallel_embedding(ids, cols, name)
        # gathered ids: every rank sees the bad one, so every rank raises (no hang).
        local = ops.shard(torch.cat([ids] * p, 1), 1)
        with pytest.raises(IndexError, match=r"torch_tp::column_parallel_embedding: ids contains"):
            torch.ops.torch_tp.column_parallel_embedding(local, cols, name, None, 1, 3 * p)
    # vocab_size=0: every id is out of range; no ids is fine.
    empty_rows = ops.shard(torch.empty(0, 4, dtype=torch.float64), 0)
    with pytest.raises(IndexError, match=r"ids contains 0, outside \[0, 0\)"):
        torch.ops.torch_tp.vocab_parallel_embedding(torch.tensor([0]), empty_rows, name, 0)
    out = torch.ops.torch_tp.vocab_parallel_embedding(torch.empty(0, dtype=torch.long), empty_rows, name, 0)
    assert out.shape == (0, 4)
    # A gather_dim mistake names this op, not torch_tp::all_gather.
    with pytest.raises(RuntimeError, match=r"^torch_tp::column_parallel_embedding: x.size\(1\)=3"):
        torch.ops.torch_tp.column_parallel_embedding(torch.zeros(2, 3, dtype=torch.long), cols, name, None, 1, 100)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_embedding_ids_out_of_range(ranks, world_size):
    ranks(world_size).run(_check_embedding_ids_out_of_range)


def test_private_linear_ops_refuse_differentiation(ranks):
    ranks(1).run(_check_private_linear_ops_refuse_differentiation)


def _check_private_linear_ops_refuse_differentiation():
    """The pieces the linear autograd kernels call are not differentiable: a
    backward through them raises naming the op (it used to warn and return
    gradients that treated their outputs as constants)."""
    x, w = _param(_full((3, 4), 1, torch.float64)), _param(_full((2, 4), 2, torch.float64))
    out, _ = torch.ops.torch_tp._column_parallel_linear_forward(x, w, None, _group(), None, None, "none")
    with pytest.raises(RuntimeError, match="_column_parallel_linear_forward"):
        out.sum().backward()
