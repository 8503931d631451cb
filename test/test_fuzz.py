"""Fuzzing the ops: random shapes, dims, dtypes, reductions, uneven
shards, NaNs and out-of-range ids, each checked on every rank against a
float64 reference computed from all ranks' inputs in one process.

The rule: the same answer as the unsharded torch computation, or an error that
names the op. hypothesis draws batches of cases (derandomized, so CI runs the
same cases every time); a batch runs on all ranks in one pool call and each
rank returns its failures. Every rank rebuilds every rank's inputs from the
case's seed, so each can compute the reference of the whole group.

Tolerances, relative to the largest magnitude of the reference (the layers'
inputs are rounded to the tested dtype first, so only arithmetic differs):
  float64   1e-10: reordered sums, ~K * 2^-53 per GEMM.
  float32   5e-5: sums of <= 15 terms (2^-24 each, ~1e-6) that may cancel to
            a tenth of a term (a bias gradient), and GELU's derivative.
  bfloat16  3e-2: 8-bit significands, a rounding per addition (p <= 3).
  integers  exact.

NaN under min and max: torch.amax/amin propagate a NaN from any rank, and so
do torch_tp's ops where torch_tp computes (the torch_tp backend, and
reduce_scatter's fold on gloo). An all_reduce on gloo is gloo's own reduction,
which keeps a NaN only when it sits on the rank its fold starts from (see
test_collectives.test_nan_under_min_max): those cases are not drawn there.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import torch_tp  # noqa: E402

from _compare import mismatch  # noqa: E402

TOL = {torch.float64: 1e-10, torch.float32: 5e-5, torch.bfloat16: 3e-2, torch.int32: 0, torch.int64: 0}
OPS = ["all_reduce", "all_gather", "reduce_scatter", "column_linear", "row_linear", "vocab_embedding",
       "column_embedding"]
REDUCE_OPS = ["sum", "avg", "min", "max", "product"]
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "int32": torch.int32, "int64": torch.int64}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rank_tensor(shape, dtype, seed, rank, nan=False):
    gen = _gen(seed * 1009 + rank)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        if nan and t.numel() > 0:
            t.view(-1)[torch.randint(t.numel(), (1,), generator=gen)] = float("nan")
        return t.to(dtype)
    return torch.randint(-4, 5, shape, generator=gen, dtype=dtype)


def _reduce(stacked, reduce_op):
    wide = stacked.double() if stacked.dtype.is_floating_point else stacked.long()
    return {"sum": lambda: wide.sum(0), "avg": lambda: wide.mean(0), "min": lambda: wide.amin(0),
            "max": lambda: wide.amax(0), "product": lambda: wide.prod(0)}[reduce_op]()


def _run_case(case):
    """Runs one case on this rank: None when right, else what was wrong."""
    rank, p = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    op, seed, dtype = case["op"], case["seed"], DTYPES[case["dtype"]]
    shape = list(case["shape"])
    expect_error = None
    try:
        if op in ("all_reduce", "reduce_scatter"):
            reduce_op = case["reduce_op"]
            xs = [_rank_tensor(shape, dtype, seed, r, nan=case["nan"]) for r in range(p)]
            if op == "all_reduce":
                out = torch.ops.torch_tp.all_reduce(xs[rank], reduce_op, name)
                ref = _reduce(torch.stack(xs), reduce_op)
            else:
                dim = case["dim"] % len(shape)
                out = torch.ops.torch_tp.reduce_scatter(xs[rank], dim, reduce_op, name)
                full = _reduce(torch.stack(xs), reduce_op)
                ref = _shard(full, dim, p, rank)
            ref = ref.to(out.dtype) if not dtype.is_floating_point else ref
            return mismatch(out, ref, op, TOL[dtype], equal_nan=True)
        if op == "all_gather":
            dim = case["dim"] % len(shape)
            n = shape[dim]
            if case["uneven"]:
                sizes = [torch_tp.chunk_range(n, p, r)[1] for r in range(p)]
                full_size = n
            else:
                sizes, full_size = [n] * p, None
            xs = []
            for r in range(p):
                s = list(shape)
                s[dim] = sizes[r]
                xs.append(_rank_tensor(s, dtype, seed, r))
            out = torch.ops.torch_tp.all_gather(xs[rank], dim, name, full_size)
            return mismatch(out, torch.cat(xs, dim), op, TOL[dtype], equal_nan=True)
        if op in ("column_linear", "row_linear"):
            return _run_linear(case, rank, p, name, dtype)
        return _run_embedding(case, rank, p, name)
    except Exception as e:  # noqa: BLE001  (judged below)
        expect_error = case.get("expect_error")
        if expect_error and expect_error in str(e):
            return None
        return f"raised {type(e).__name__}: {str(e).splitlines()[0]}"


def _shard(t, dim, p, r):
    pieces = torch.chunk(t, p, dim)
    return pieces[r].contiguous() if r < len(pieces) else t.narrow(dim, 0, 0).contiguous()


def _run_linear(case, rank, p, name, dtype):
    b_, s_, k_, n_ = case["shape"][0], case["shape"][1], case["k"], case["n"]
    g = _gen(case["seed"])
    x = torch.randn(b_, s_, k_, generator=g, dtype=torch.float64)
    w = torch.randn(n_, k_, generator=g, dtype=torch.float64)
    b = torch.randn(n_, generator=g, dtype=torch.float64) if case["bias"] else None
    grad = torch.randn(b_, s_, n_, generator=g, dtype=torch.float64)
    x, w, grad = (t.to(dtype).double() for t in (x, w, grad))
    b = b.to(dtype).double() if b is not None else None
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_b = b.clone().requires_grad_() if b is not None else None
    ref_y = F.linear(ref_x, ref_w, ref_b)
    if case["op"] == "column_linear" and case["activation"] == "gelu_tanh":
        ref_y = F.gelu(ref_y, approximate="tanh")
    ref_y.backward(grad)
    seq = case["seq_parallel"]
    cast = dict(dtype=dtype)
    if case["op"] == "column_linear":
        x_r = (_shard(x, 1, p, rank) if seq else x).to(**cast).requires_grad_()
        w_r = _shard(w, 0, p, rank).to(**cast).requires_grad_()
        b_r = _shard(b, 0, p, rank).to(**cast).requires_grad_() if b is not None else None
        y = torch.ops.torch_tp.column_parallel_linear(x_r, w_r, b_r, name, 1 if seq else None,
                                                      s_ if seq else None, case["activation"])
        y_ref, g_out = _shard(ref_y.detach(), -1, p, rank), _shard(grad, -1, p, rank)
        gx_ref = _shard(ref_x.grad, 1, p, rank) if seq else ref_x.grad
        gw_ref = _shard(ref_w.grad, 0, p, rank)
        gb_ref = _shard(ref_b.grad, 0, p, rank) if b is not None else None
    else:
        x_r = _shard(x, -1, p, rank).to(**cast).requires_grad_()
        w_r = _shard(w, 1, p, rank).to(**cast).requires_grad_()
        b_r = b.to(**cast).requires_grad_() if b is not None else None
        y = torch.ops.torch_tp.row_parallel_linear(x_r, w_r, b_r, name, 1 if seq else None)
        y_ref = _shard(ref_y.detach(), 1, p, rank) if seq else ref_y.detach()
        g_out = _shard(grad, 1, p, rank) if seq else grad
        gx_ref, gw_ref = _shard(ref_x.grad, -1, p, rank), _shard(ref_w.grad, 1, p, rank)
        gb_ref = ref_b.grad if b is not None else None
    problems = [mismatch(y.detach(), y_ref, "output", TOL[dtype], equal_nan=True)]
    y.backward(g_out.to(dtype))
    problems += [mismatch(x_r.grad, gx_ref, "grad_x", TOL[dtype], equal_nan=True),
                 mismatch(w_r.grad, gw_ref, "grad_weight", TOL[dtype], equal_nan=True)]
    if b is not None:
        problems.append(mismatch(b_r.grad, gb_ref, "grad_bias", TOL[dtype], equal_nan=True))
    problems = [pr for pr in problems if pr]
    return "; ".join(problems) if problems else None


def _run_embedding(case, rank, p, name):
    vocab, dim_ = case["vocab"], 3
    g = _gen(case["seed"])
    weight = torch.randn(vocab, dim_, generator=g, dtype=torch.float64)
    ids = torch.randint(0, max(vocab, 1), tuple(case["shape"]), generator=g)
    if case["bad_id"] is not None and ids.numel() > 0:
        ids.view(-1)[0] = case["bad_id"]
    valid = ids.numel() == 0 or bool(((ids >= 0) & (ids < vocab)).all())
    if case["op"] == "vocab_embedding":
        case["expect_error"] = "torch_tp::vocab_parallel_embedding"
        sd = case["dim"] % ids.dim() if case["seq_parallel"] else None
        out = torch.ops.torch_tp.vocab_parallel_embedding(ids, _shard(weight, 0, p, rank), name, vocab, None, sd)
        if not valid:
            return "no error for an id out of range"
        ref = F.embedding(ids, weight)
        return mismatch(out, _shard(ref, sd, p, rank) if sd is not None else ref, "vocab_embedding",
                        TOL[torch.float64], equal_nan=True)
    case["expect_error"] = "torch_tp::column_parallel_embedding"
    gd = case["dim"] % ids.dim() if case["seq_parallel"] else None
    local = _shard(ids, gd, p, rank) if gd is not None else ids
    full_size = ids.size(gd) if gd is not None else None
    out = torch.ops.torch_tp.column_parallel_embedding(local, _shard(weight, 1, p, rank), name, None, gd, full_size)
    if not valid:
        return "no error for an id out of range"
    return mismatch(out, _shard(F.embedding(ids, weight), -1, p, rank), "column_embedding", TOL[torch.float64],
                    equal_nan=True)


def _run_cases(cases):
    failures = []
    for case in cases:
        problem = _run_case(dict(case))
        if problem:
            failures.append(f"{case}: {problem}")
    return failures


def _case(draw, backend):
    op = draw(st.sampled_from(OPS))
    case = {"op": op, "seed": draw(st.integers(0, 10_000)), "dim": draw(st.integers(-3, 2))}
    if op in ("all_reduce", "reduce_scatter", "all_gather"):
        case["shape"] = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
        case["dtype"] = draw(st.sampled_from(list(DTYPES)))
        reduce_op = draw(st.sampled_from(REDUCE_OPS))
        if reduce_op == "avg" and not DTYPES[case["dtype"]].is_floating_point:
            reduce_op = "sum"
        case["reduce_op"] = reduce_op
        # gloo reduces an all_reduce itself, with its own NaN rule (module docstring).
        nan_ok = DTYPES[case["dtype"]].is_floating_point and not (
            backend == "gloo" and op == "all_reduce" and reduce_op in ("min", "max"))
        case["nan"] = nan_ok and draw(st.booleans())
        case["uneven"] = draw(st.booleans())
    elif op in ("column_linear", "row_linear"):
        case["shape"] = [draw(st.integers(1, 3)), draw(st.integers(1, 5))]
        case["k"], case["n"] = draw(st.integers(1, 6)), draw(st.integers(1, 6))
        case["dtype"] = draw(st.sampled_from(["float64", "float32"]))
        case["bias"] = draw(st.booleans())
        case["activation"] = draw(st.sampled_from(["none", "gelu_tanh"]))
        case["seq_parallel"] = draw(st.booleans())
    else:
        case["shape"] = draw(st.lists(st.integers(0, 4), min_size=1, max_size=2))
        case["dtype"] = "float64"
        case["vocab"] = draw(st.integers(0, 7))
        case["bad_id"] = draw(st.one_of(st.none(), st.sampled_from([-1, -(2 ** 63), 2 ** 63 - 1]),
                                        st.integers(7, 9)))
        case["seq_parallel"] = draw(st.booleans())
    return case


BATCH = 40  # cases per pool call: one round trip to the ranks per batch


@pytest.mark.parametrize("world_size", [2, 3])
def test_fuzz_ops_against_float64_reference(ranks, world_size):
    """hypothesis batches of random cases (500+ per world size); every rank
    checks its result against the float64 reference of all ranks."""
    pool = ranks(world_size)
    backend = os.environ.get("TORCH_TP_TEST_BACKEND", "gloo")
    batch = st.lists(st.composite(lambda draw: _case(draw, backend))(), min_size=BATCH, max_size=BATCH)

    # No shrinking: a failure already lists its cases, and shrinking 40-case
    # batches over a pool could run for minutes.
    @settings(max_examples=14, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batch)
    def check(cases):
        results = pool.run(_run_cases, cases)
        failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
        assert not failures, "\n".join(failures[:10])

    check()
