"""Sharded linear and embedding ops against the unsharded nn.Linear / nn.Embedding.

Every rank builds the full weights and input (same seed everywhere), takes its
torch.chunk shard (DTensor's Shard(dim), uneven when the size does not divide),
runs the op, and compares output and gradients with the unsharded module run
in the same process. The upstream gradient G of the full output is the same on
every rank; a rank whose output is a shard backpropagates its shard of G.

Tolerances, relative to the largest magnitude of the reference tensor (so
entries near zero are judged on the tensor's scale):
  float64   1e-10: reordered sums, ~K * 2^-53 per GEMM.
  float32   1e-5:  the issue's bound; GEMM blocking and the p-way split
            reorder K-term sums (K <= 64 here, 2^-24 each).
  bfloat16  3e-2:  8-bit significands (2^-8 = 3.9e-3); a row-parallel output
            is rounded in each rank's partial GEMM and again in each of up to
            p - 1 bf16 additions of the reduction, so up to ~5 roundings at
            p = 4, plus the reference's own rounding of its inputs.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_tp import ops

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _close(actual, expected, dtype, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    scale = expected.double().abs().max().clamp_min(1e-30)
    error = (actual.double() - expected.double()).abs().max() / scale
    assert error <= TOL[dtype], f"{what}: max error {error:.3e} of the scale exceeds {TOL[dtype]:.0e}"


def _full(shape, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _group():
    return dist.group.WORLD.group_name


def _param(t):
    return t.detach().clone().requires_grad_()


# ---------------------------------------------------------------- linear


def _check_column(dtype, in_features, out_features, seq, bias, sequence_parallel, activation):
    """column_parallel_linear vs nn.Linear (+ GELU): output shard along the
    features; grad_x all-reduced (or reduce-scattered along the sequence)."""
    batch = 2
    weight = _full((out_features, in_features), 1, dtype)
    b = _full((out_features,), 2, dtype) if bias else None
    x = _full((batch, seq, in_features), 3, dtype)
    grad = _full((batch, seq, out_features), 4, dtype)

    ref_x, ref_w = _param(x), _param(weight)
    ref_b = _param(b) if bias else None
    ref_y = F.linear(ref_x, ref_w, ref_b)
    if activation == "gelu_tanh":
        ref_y = F.gelu(ref_y, approximate="tanh")
    ref_y.backward(grad)

    w_r = _param(ops.shard(weight, 0))
    b_r = _param(ops.shard(b, 0)) if bias else None
    x_r = _param(ops.shard(x, 1) if sequence_parallel else x)
    y = torch.ops.torch_tp.column_parallel_linear(
        x_r, w_r, b_r, _group(), 1 if sequence_parallel else None, seq if sequence_parallel else None, activation)
    _close(y, ops.shard(ref_y, -1), dtype, "output")
    y.backward(ops.shard(grad, -1))
    _close(x_r.grad, ops.shard(ref_x.grad, 1) if sequence_parallel else ref_x.grad, dtype, "grad_x")
    _close(w_r.grad, ops.shard(ref_w.grad, 0), dtype, "grad_weight")
    if bias:
        _close(b_r.grad, ops.shard(ref_b.grad, 0), dtype, "grad_bias")


def _check_row(dtype, in_features, out_features, seq, bias, sequence_parallel):
    """row_parallel_linear vs nn.Linear: input shard along the features, output
    all-reduced (or reduce-scattered along the sequence), bias added once."""
    batch = 2
    weight = _full((out_features, in_features), 5, dtype)
    b = _full((out_features,), 6, dtype) if bias else None
    x = _full((batch, seq, in_features), 7, dtype)
    grad = _full((batch, seq, out_features), 8, dtype)

    ref_x, ref_w = _param(x), _param(weight)
    ref_b = _param(b) if bias else None
    ref_y = F.linear(ref_x, ref_w, ref_b)
    ref_y.backward(grad)

    w_r = _param(ops.shard(weight, 1))
    b_full = _param(b) if bias else None
    x_r = _param(ops.shard(x, -1))
    y = torch.ops.torch_tp.row_parallel_linear(x_r, w_r, b_full, _group(), 1 if sequence_parallel else None)
    _close(y, ops.shard(ref_y, 1) if sequence_parallel else ref_y, dtype, "output")
    y.backward(ops.shard(grad, 1) if sequence_parallel else grad)
    _close(x_r.grad, ops.shard(ref_x.grad, -1), dtype, "grad_x")
    _close(w_r.grad, ops.shard(ref_w.grad, 1), dtype, "grad_weight")
    if bias:
        # Complete on every rank, also under sequence parallelism (see NOTE [no partial gradients]).
        _close(b_full.grad, ref_b.grad, dtype, "grad_bias")


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
    _close(ops.all_reduce(x_r.grad, "sum"), ref_x.grad, dtype, "summed partial grad_x")
    _close(w_r.grad, ops.shard(ref_w.grad, 0), dtype, "grad_weight")
    with pytest.raises(RuntimeError, match="partial_grad_input=True does not combine with gather_dim"):
        torch.ops.torch_tp.column_parallel_linear(
            _param(ops.shard(x, 1)), w_r, None, _group(), 1, 5, partial_grad_input=True).sum().backward()


@pytest.mark.parametrize("world_size", [1, 3])
def test_column_partial_grad_input(ranks, world_size):
    ranks(world_size).run(_check_column_partial_grad_input)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_column_parallel_linear(ranks, world_size):
    pool = ranks(world_size)
    for dtype in [torch.float32, torch.float64, torch.bfloat16]:
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
    for dtype in [torch.float32, torch.float64, torch.bfloat16]:
        for sequence_parallel in [False, True]:
            pool.run(_check_row, dtype, 24, 16, 8, True, sequence_parallel)
            pool.run(_check_row, dtype, 14, 10, 7, True, sequence_parallel)
    pool.run(_check_row, torch.float32, 20, 12, 6, False, False)
    pool.run(_check_row, torch.float32, 3, 5, 2, True, True)  # more ranks than rows and features


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
    _close(compiled, eager, torch.float32, "compiled output")
    for p, g in zip(params, eager_grads):
        _close(p.grad, g, torch.float32, "compiled grad")


@pytest.mark.parametrize("world_size", [2])
def test_compile_column_row_mlp(ranks, world_size):
    pool = ranks(world_size)
    pool.run(_check_compiled_mlp, False, timeout=600)
    pool.run(_check_compiled_mlp, True, timeout=600)


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
    _close(out, ops.shard(ref, 1) if sequence_parallel else ref, dtype, "output")
    out.backward(ops.shard(grad, 1) if sequence_parallel else grad)
    _close(w_r.grad, ops.shard(ref_w.grad, 0), dtype, "grad_weight")  # empty on a rank that owns no rows
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
    _close(out, ops.shard(ref, -1), dtype, "output")
    out.backward(ops.shard(grad, -1))
    _close(w_r.grad, ops.shard(ref_w.grad, 1), dtype, "grad_weight")


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
    ]
    if world_size > 1:
        cases.append((lambda: col(torch.randn(2, 3, 8), w, None, group, 1, 10),
                      ["torch_tp::column_parallel_linear", "x.size(1)=3", "full_size=10"]))
    for call, fragments in cases:
        with pytest.raises(RuntimeError) as info:
            call()
        message = str(info.value)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in error: {message}"
    # The Meta kernels check the same way.
    with pytest.raises(RuntimeError, match="weight.size.1.=7"):
        col(x.to("meta"), torch.randn(6, 7, device="meta"), None, group)


@pytest.mark.parametrize("world_size", [1, 2])
def test_errors(ranks, world_size):
    ranks(world_size).run(_check_errors)


# ---------------------------------------------------------------- CUDA (run where a GPU is present)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _check_cuda_linear():
    """The cuBLASLt forward (bias and GELU in the epilogue) and the backward on
    CUDA against nn.Linear on the same device. bf16 and fp16 follow the bf16
    tolerance; fp32 runs with TF32 off so that it meets the fp32 one."""
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    group = _group()
    for dtype, tol_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                             (torch.float16, torch.bfloat16)]:
        for activation in ["none", "gelu_tanh"]:
            for out_features in [64, 36]:  # 36 (9 per rank at 4) is not a multiple of 8: no fused GELU aux
                x = _full((4, 16, 32), 1, dtype).to(device)
                w = _full((out_features, 32), 2, dtype).to(device)
                b = _full((out_features,), 3, dtype).to(device)
                ref_x, ref_w, ref_b = _param(x), _param(w), _param(b)
                ref = F.linear(ref_x, ref_w, ref_b)
                if activation == "gelu_tanh":
                    ref = F.gelu(ref, approximate="tanh")
                grad = _full(tuple(ref.shape), 4, dtype).to(device)
                ref.backward(grad)
                x_r, w_r, b_r = _param(x), _param(ops.shard(w, 0)), _param(ops.shard(b, 0))
                y = torch.ops.torch_tp.column_parallel_linear(x_r, w_r, b_r, group, None, None, activation)
                _close(y, ops.shard(ref, -1), tol_dtype, f"cuda {dtype} {activation} output")
                y.backward(ops.shard(grad, -1))
                _close(x_r.grad, ref_x.grad, tol_dtype, "cuda grad_x")
                _close(w_r.grad, ops.shard(ref_w.grad, 0), tol_dtype, "cuda grad_weight")
                _close(b_r.grad, ops.shard(ref_b.grad, 0), tol_dtype, "cuda grad_bias")

                h = _full((4, 16, out_features), 5, dtype).to(device)
                w2 = _full((32, out_features), 6, dtype).to(device)
                b2 = _full((32,), 7, dtype).to(device)
                y = torch.ops.torch_tp.row_parallel_linear(ops.shard(h, -1), ops.shard(w2, 1), b2, group)
                _close(y, F.linear(h, w2, b2), tol_dtype, f"cuda {dtype} row output")


@needs_cuda
def test_cuda_linear_nccl(ranks):
    ranks(1, "cpu:gloo,cuda:nccl").run(_check_cuda_linear)


@needs_cuda
@pytest.mark.parametrize("world_size", [2])
def test_cuda_linear_gloo(ranks, world_size):
    ranks(world_size, "gloo").run(_check_cuda_linear)
