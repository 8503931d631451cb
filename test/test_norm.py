"""torch_tp::rms_norm against torch's rms_norm, and SequenceParallel's nn.RMSNorm against torch's style.

The op is torch's rms_norm fused on the CPU (NOTE [fused RMSNorm on the CPU] in
csrc/ops/norm.cpp): the same float formula, the sums taken in another order.
Tolerances, relative to the reference's largest magnitude (_compare.py):
  float64   1e-14: sums of up to ~1,000 terms reordered, 2^-53 each.
  float32   2^-18: the same in float32 (2^-24 each); the weight's gradient sums
            a product over every row.
  bfloat16  2^-8:  one rounding of the same float32 value on both sides; a sum
            in another order can land it on the neighbouring bfloat16 (one
            ulp, 2^-8 relative at most).
Where the op hands the call to torch (float16, mixed dtypes, forward-mode AD,
other devices) the results must be torch's exactly.
"""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
import torch.distributed.tensor.parallel as torch_tp_api
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tp

from _compare import assert_close, assert_error_names

TOL = {torch.float64: 1e-14, torch.float32: 2.0**-18, torch.bfloat16: 2.0**-8}
rms_norm = torch.ops.torch_tp.rms_norm


def _randn(shape, seed, dtype, *, low=None):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float64)
    if low is not None:  # a weight: positive, away from 0
        t = t.abs() + low
    return t.to(dtype)


def _run(fn, x, weight, normalized_shape, eps, grad):
    """fn's output and the gradients of x and weight (the ones that require grad) for ``grad``."""
    out = fn(x, normalized_shape, weight, eps)
    inputs = [t for t in (x, weight) if t is not None and t.requires_grad]
    return out, torch.autograd.grad(out, inputs, grad) if inputs else ()


def _compare_with_torch(x, weight, normalized_shape, eps, grad, tol, what):
    ours = _run(rms_norm, x, weight, normalized_shape, eps, grad)
    theirs = _run(F.rms_norm, x, weight, normalized_shape, eps, grad)
    assert ours[0].dtype == theirs[0].dtype, what
    assert_close(ours[0], theirs[0], f"{what}: output", tol)
    for name, a, b in zip(("grad input", "grad weight"), ours[1], theirs[1]):
        assert a.dtype == b.dtype, what
        assert_close(a, b, f"{what}: {name}", tol)


SHAPES = [
    ((4, 32, 256), [256]),  # the example's sequence-parallel shard
    ((3, 5, 7, 6), [7, 6]),  # two normalized dims, rows of 42
    ((2, 33), [33]),  # a row length no vector width divides
    ((1, 1, 4096), [4096]),  # one long row (a decode token)
    ((0, 8), [8]),  # no rows
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape,normalized_shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-5, None])
@pytest.mark.parametrize("affine", [True, False])
def test_matches_torch(dtype, shape, normalized_shape, eps, affine):
    x = _randn(shape, 1, dtype).requires_grad_()
    weight = _randn(normalized_shape, 2, dtype, low=0.5).requires_grad_() if affine else None
    grad = _randn(shape, 3, dtype)
    _compare_with_torch(x, weight, normalized_shape, eps, grad, TOL[dtype], f"{dtype} {shape} eps={eps}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_rows(dtype):
    """A row holding a NaN or an inf is NaN where torch's is, and equal elsewhere (a NaN's bits are not
    compared: torch's vectorised bfloat16 conversion keeps a payload, c10's scalar one and this op store 0x7FC0)."""
    x = _randn((4, 16), 1, dtype)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    weight = _randn((16,), 2, dtype, low=0.5)
    ours, theirs = rms_norm(x, [16], weight, 1e-5), F.rms_norm(x, [16], weight, 1e-5)
    assert torch.equal(ours.isnan(), theirs.isnan()), (ours, theirs)
    assert_close(ours, theirs, f"{dtype} rows with NaN and inf", TOL[dtype], equal_nan=True)


def test_one_gradient_at_a_time():
    """Only the gradient asked for is computed (the backward's output_mask); each equals torch's."""
    x, weight, grad = _randn((6, 40), 1, torch.float32), _randn((40,), 2, torch.float32, low=0.5), _randn((6, 40), 3,
                                                                                                     torch.float32)
    for x_grad, w_grad in [(True, False), (False, True)]:
        xs, ws = x.clone().requires_grad_(x_grad), weight.clone().requires_grad_(w_grad)
        _compare_with_torch(xs, ws, [40], 1e-6, grad, TOL[torch.float32], f"x grad {x_grad}, weight grad {w_grad}")


def test_threads_and_layouts():
    """Two intra-op threads (the rows split between them, the weight's gradient summed from a partial sum per
    thread) and a non-contiguous input give torch's numbers."""
    x = _randn((96, 1024), 1, torch.float32)  # 96K elements: above ATen's grain, so the rows split
    weight = _randn((1024,), 2, torch.float32, low=0.5).requires_grad_()
    grad = _randn((96, 1024), 3, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _compare_with_torch(x.clone().requires_grad_(), weight, [1024], 1e-5, grad, TOL[torch.float32], "2 threads")
    finally:
        torch.set_num_threads(threads)
    transposed = _randn((1024, 96), 4, torch.float32).t().requires_grad_()  # [96, 1024], strides (1, 96)
    assert not transposed.is_contiguous()
    _compare_with_torch(transposed, weight, [1024], 1e-5, grad, TOL[torch.float32], "non-contiguous")


@pytest.mark.parametrize("case", ["float16", "bfloat16 input, float32 weight", "meta"])
def test_other_calls_are_torchs(case):
    """What the fused kernels do not take goes to torch's rms_norm: the same tensors, bit for bit."""
    dtype, weight_dtype, device = {
        "float16": (torch.float16, torch.float16, "cpu"),
        "bfloat16 input, float32 weight": (torch.bfloat16, torch.float32, "cpu"),
        "meta": (torch.float32, torch.float32, "meta"),
    }[case]
    x = _randn((4, 16, 64), 1, dtype).to(device).requires_grad_()
    weight = _randn((64,), 2, weight_dtype, low=0.5).to(device).requires_grad_()
    grad = _randn((4, 16, 64), 3, dtype).to(device)
    ours = _run(rms_norm, x, weight, [64], 1e-5, grad)
    theirs = _run(F.rms_norm, x, weight, [64], 1e-5, grad)
    for a, b in zip((ours[0], *ours[1]), (theirs[0], *theirs[1])):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, case
        if device != "meta":
            assert torch.equal(a, b), case


def test_forward_mode_ad_is_torchs():
    """A forward-mode tangent goes to torch's rms_norm (a C++ autograd Function has no forward mode)."""
    import torch.autograd.forward_ad as fwAD
    x, tangent = _randn((5, 24), 1, torch.float64), _randn((5, 24), 2, torch.float64)
    weight = _randn((24,), 3, torch.float64, low=0.5)
    results = []
    for fn in (rms_norm, F.rms_norm):
        with fwAD.dual_level():
            out = fn(fwAD.make_dual(x, tangent), [24], weight, 1e-6)
            results.append(fwAD.unpack_dual(out))
    assert torch.equal(results[0].primal, results[1].primal)
    assert torch.equal(results[0].tangent, results[1].tangent)


def test_double_backward():
    """create_graph=True: the gradients are differentiable again (torch's rms_norm recomputed in the backward)."""
    x = _randn((3, 10), 1, torch.float64).requires_grad_()
    weight = _randn((10,), 2, torch.float64, low=0.5).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda a, w: rms_norm(a, [10], w, 1e-6), (x, weight))


def test_no_grad_builds_no_graph():
    x = _randn((4, 8), 1, torch.float32).requires_grad_()
    weight = _randn((8,), 2, torch.float32, low=0.5).requires_grad_()
    with torch.no_grad():
        assert rms_norm(x, [8], weight).grad_fn is None
    assert rms_norm(x, [8], weight).grad_fn is not None
    assert rms_norm(x.detach(), [8], weight.detach()).grad_fn is None


def test_opcheck():
    """The schemas, the Meta kernels (shapes, strides, dtypes against the CPU kernels', every output_mask) and
    the autograd registration, as torch.library checks a custom op."""
    x = _randn((2, 3, 8), 1, torch.float64).requires_grad_()
    weight = _randn((8,), 2, torch.float64, low=0.5).requires_grad_()
    for args in [(x, [8], weight, 1e-6), (x, [8], None, None), (x, [3, 8], None, 1e-6),
                 (x.detach().bfloat16().requires_grad_(), [8], weight.detach().bfloat16(), None)]:
        torch.library.opcheck(rms_norm.default, args)
    x, weight = x.detach(), weight.detach()
    out, rstd = torch.ops.torch_tp._rms_norm_forward(x, [8], weight, 1e-6)
    torch.library.opcheck(torch.ops.torch_tp._rms_norm_forward.default, (x, [8], weight, 1e-6))
    for mask in itertools.product([False, True], repeat=2):
        for w in (weight, None):
            torch.library.opcheck(torch.ops.torch_tp._rms_norm_backward.default,
                                  (_randn((2, 3, 8), 3, torch.float64), x, w, rstd, [8], list(mask)))


def test_compiled_matches_eager():
    """torch.compile(fullgraph=True) traces the op (forward and backward) and gives the eager numbers."""
    def fn(x, weight):
        return rms_norm(x * 2, [64], weight, 1e-5).sum()

    x = _randn((4, 16, 64), 1, torch.float32)
    weight = _randn((64,), 2, torch.float32, low=0.5)
    grads = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = f(xs, ws)
        out.backward()
        grads.append((out.detach(), xs.grad, ws.grad))
    for name, a, b in zip(("output", "grad input", "grad weight"), *grads):
        assert_close(a, b, f"compiled {name}", TOL[torch.float32])


def test_errors_name_the_op_and_argument():
    x = torch.randn(2, 8)
    assert_error_names(lambda: rms_norm(x, [4]), ["torch_tp::rms_norm", "normalized_shape=[4]", "[2, 8]"])
    assert_error_names(lambda: rms_norm(x, []), ["torch_tp::rms_norm", "normalized_shape"])
    assert_error_names(lambda: rms_norm(x, [8], torch.ones(4)), ["torch_tp::rms_norm", "weight", "[4]", "[8]"])
    assert_error_names(lambda: rms_norm(x.long(), [8]), ["torch_tp::rms_norm", "input", "Long"])
    assert_error_names(lambda: rms_norm(x, [8], torch.ones(8, device="meta")), ["torch_tp::rms_norm", "weight",
                                                                                 "meta", "cpu"])
    assert_error_names(lambda: torch.ops.torch_tp._rms_norm_forward(x.half(), [8], None, None),
                       ["torch_tp::rms_norm", "Half"])
    assert_error_names(lambda: torch.ops.torch_tp._rms_norm_backward(torch.randn(2, 8), x, None, torch.ones(3), [8],
                                                                     [True, False]),
                       ["torch_tp::rms_norm backward", "rstd", "[3]"])


# ---------------------------------------------------------------- SequenceParallel's nn.RMSNorm


class _OpsSeen(TorchDispatchMode):
    """The names of the ops dispatched while it is on (``names``)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._opname)
        return func(*args, **(kwargs or {}))


class _OwnRMSNorm(nn.RMSNorm):
    """A subclass with a forward of its own: SequenceParallel must run that forward, not the fused op."""

    calls = 0

    def forward(self, x):
        _OwnRMSNorm.calls += 1
        return super().forward(x) * 2


def _check_sequence_parallel_norms():
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    cases = [
        (lambda: nn.RMSNorm(32), torch.float32),
        (lambda: nn.RMSNorm(32, eps=None), torch.float32),
        (lambda: nn.RMSNorm(32, elementwise_affine=False), torch.float32),
        (lambda: nn.RMSNorm([4, 32]), torch.float32),
        (lambda: nn.RMSNorm(32), torch.bfloat16),
        (lambda: nn.RMSNorm(32), torch.float16),  # torch's own rms_norm inside the op
        (lambda: _OwnRMSNorm(32), torch.float32),
    ]
    for i, (make, dtype) in enumerate(cases):
        torch.manual_seed(i)
        reference = make().to(dtype)
        if reference.weight is not None:
            with torch.no_grad():
                reference.weight.uniform_(0.5, 1.5)
        ours, theirs = (torch_tp.parallelize_module(make().to(dtype), mesh, torch_tp.SequenceParallel()),
                        torch_tp_api.parallelize_module(make().to(dtype), mesh, torch_tp_api.SequenceParallel()))
        if reference.weight is not None:
            for module in (ours, theirs):
                module.weight.data.copy_(DTensor.from_local(reference.weight.detach(), mesh, module.weight.placements))
        x = _randn((2, 4 * world_size, 4, 32), 10 + i, dtype)
        grad = _randn(x.shape, 20 + i, dtype)
        what = f"{type(reference).__name__}{tuple(reference.normalized_shape)} eps={reference.eps} {dtype}"
        calls = _OwnRMSNorm.calls
        outputs = {}
        for name, module in (("torch_tp", ours), ("torch", theirs)):
            local = torch_tp.shard(x, 1).requires_grad_()
            with _OpsSeen() as seen:
                out = module(DTensor.from_local(local, mesh, [Shard(1)], run_check=False))
                out.to_local().backward(torch_tp.shard(grad, 1))
            outputs[name] = out
            outputs[name + " grad"] = local.grad
            if name == "torch_tp":  # the fused kernels ran where they take the call, and only there
                fused = type(reference) is nn.RMSNorm and dtype != torch.float16
                assert ({"_rms_norm_forward", "_rms_norm_backward"} <= seen.names) == fused, (what, seen.names)
        tol = TOL.get(dtype, 0.0)
        assert_close(outputs["torch_tp"], outputs["torch"], f"{what}: output", tol)
        assert_close(outputs["torch_tp grad"], outputs["torch grad"], f"{what}: grad input", tol)
        if reference.weight is not None:
            assert_close(ours.weight.grad, theirs.weight.grad, f"{what}: grad weight", tol)
        if isinstance(reference, _OwnRMSNorm):
            assert _OwnRMSNorm.calls == calls + 2, "the subclass's own forward ran in both libraries"


@pytest.mark.parametrize("world_size", [2])
def test_sequence_parallel_rms_norm_matches_torch(ranks, world_size):
    """SequenceParallel's nn.RMSNorm (fused on the CPU) against torch's SequenceParallel on the same module: the
    output, the input's gradient and the weight's (Partial sums completed by the end-of-backward all-reduce),
    float32, bfloat16 and float16, with and without a weight, eps None, two normalized dims, and a subclass
    with a forward of its own (which must run)."""
    ranks(world_size).run(_check_sequence_parallel_norms, timeout=300)


class _ProjectedNorm(nn.Module):
    """A projection into the residual stream, a residual add and a norm: torchtitan's block in miniature,
    whose norm reads a plain sequence shard, the global length of which the projection recorded."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32, bias=False)
        self.norm = nn.RMSNorm(32)

    def forward(self, x):
        h = self.proj(x)
        return self.norm(h + h)


def _check_norm_of_plain_shards():
    from torch.distributed.tensor import Replicate

    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    # (sequence length, use_local_output): even and uneven (torch.chunk) pieces, a DTensor and a plain output
    for seq, use_local_output in ((4 * world_size, False), (4 * world_size + 1, False), (4 * world_size, True)):
        what = f"seq {seq}, use_local_output={use_local_output}"
        torch.manual_seed(seq)
        reference = _ProjectedNorm().double()
        with torch.no_grad():
            reference.norm.weight.uniform_(0.5, 1.5)
        ours = torch_tp.parallelize_module(copy.deepcopy(reference), mesh, {
            "proj": torch_tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": torch_tp.SequenceParallel(use_local_output=use_local_output),
        })
        x = _randn((2, seq, 16), seq, torch.float64)
        grad = _randn((2, seq, 32), seq + 1, torch.float64)
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected = reference(x_ref)
        expected.backward(grad)
        with _OpsSeen() as seen:
            out = ours(x_tp)
            if use_local_output:
                assert type(out) is torch.Tensor, what
                local = out
            else:
                assert isinstance(out, DTensor) and out.placements == (Shard(1),), what
                assert out.shape == expected.shape, (what, out.shape)
                local = out.to_local()
            local.backward(torch_tp.shard(grad, 1))
        assert {"_rms_norm_forward", "_rms_norm_backward"} <= seen.names, (what, seen.names)
        tol = TOL[torch.float64]
        assert_close(local, torch_tp.shard(expected.detach(), 1), f"{what}: output", tol)
        if not use_local_output:
            assert_close(out.full_tensor(), expected.detach(), f"{what}: full output", tol)
        assert_close(x_tp.grad, x_ref.grad, f"{what}: grad input", tol)
        assert_close(ours.norm.weight.grad.full_tensor(), reference.norm.weight.grad, f"{what}: grad norm weight",
                     tol)
        assert_close(ours.proj.weight.grad.full_tensor(), reference.proj.weight.grad, f"{what}: grad proj weight",
                     tol)
    # A plain shard whose length no module recorded (the pieces' lengths are exchanged), and a DTensor.
    lone = torch_tp.parallelize_module(copy.deepcopy(reference.norm), mesh, torch_tp.SequenceParallel())
    h = _randn((2, 4 * world_size + 1, 32), 7, torch.float64)
    out = lone(torch_tp.shard(h, 1))
    assert_close(out.full_tensor(), reference.norm(h).detach(), "unrecorded length: full output",
                 TOL[torch.float64])
    out = lone(DTensor.from_local(torch_tp.shard(h, 1), mesh, [Shard(1)], run_check=False, shape=h.shape,
                                  stride=h.stride()))
    assert_close(out.full_tensor(), reference.norm(h).detach(), "DTensor input: full output", TOL[torch.float64])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sequence_parallel_norm_of_plain_shards(ranks, world_size):
    """The norm of a plain sequence shard whose global length the forward recorded (the residual stream of
    torchtitan's plan) runs the fused kernels and gives the unsharded module's output and gradients: even and
    uneven pieces, DTensor and plain outputs, float64 (tolerance: the projection's partial sums reordered, TOL above)."""
    ranks(world_size).run(_check_norm_of_plain_shards, timeout=300)
