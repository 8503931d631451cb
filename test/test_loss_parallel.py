"""torch_tp.parallel.loss.loss_parallel against F.cross_entropy and torch's loss_parallel.

The logits come the way users get them: a small model whose output nn.Linear is
parallelized by torch's own parallelize_module with
ColwiseParallel(use_local_output=False) on a 1-D mesh, so they are a DTensor
[batch, seq, vocab] with placements (Shard(2),), flattened to [batch * seq,
vocab] as torchtitan does. Every rank builds the same model, input and labels
(same seeds), and also runs the unsharded copy of the model in-process.

Each loss is compared, value and gradient with respect to the logits (a leaf
DTensor detached from the model output), against
  (a) F.cross_entropy / F.nll_loss on the unsharded logits, and
  (b) torch.distributed.tensor.parallel.loss_parallel on the identical DTensor.
Vocab sizes include uneven splits (10 classes over 3 ranks: 4, 4, 2; over 4
ranks: 3, 3, 3, 1) and a rank holding no class (5 over 4: 2, 2, 1, 0).

Tolerances (fp32), relative to the largest magnitude of the reference:
  vs unsharded  1e-5: the p-way split reorders the V-term sum of exp (the max
                is exact), and the gradient's softmax divides by that sum:
                a few ulp (2^-24 ~ 6e-8) per term, far below 1e-5 for V <= 64.
  vs torch      1e-6: the same shifted logits, max and all-reduced sum of exp;
                torch forms log-probabilities x - m - log S then picks
                (ours: log S - (x_t - m)) and its gradient is exp(logp) where
                ours is exp(x - m) / S: one or two roundings apart.
"""

import itertools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
import torch.distributed.tensor.parallel
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tp
from torch_tp.ops import _COMMUNICATING_OPS
from torch_tp.parallel.loss import loss_parallel

from _compare import assert_close, assert_error_names

WORLD_SIZES = [1, 2, 3, 4]
REDUCTIONS = ["mean", "sum", "none"]
VS_UNSHARDED = 1e-5
VS_TORCH = 1e-6
BATCH, SEQ, HIDDEN = 2, 5, 8

_MESH = {}

# torch's loss_parallel takes a multi-dimensional DeviceMesh from torch 2.13; 2.11 and 2.12 refuse
# one ("only supports input on one-dimensional DeviceMesh"), so there is nothing to compare with.
needs_torch_2d_loss_parallel = pytest.mark.skipif(
    torch.__version__ < (2, 13),
    reason=f"torch {torch.__version__}'s loss_parallel refuses a multi-dimensional DeviceMesh (torch 2.13 added it)")


def _mesh():
    world = dist.get_world_size()
    if world not in _MESH:
        _MESH[world] = init_device_mesh("cpu", (world,))
    return _MESH[world]


class _Head(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, vocab)

    def forward(self, x):
        return self.out(torch.tanh(self.proj(x)))


def _models(vocab, seed=0, api=torch.distributed.tensor.parallel):
    """(tensor-parallel model, unsharded copy, input x): the same on every rank. ``api``: the
    module whose parallelize_module and ColwiseParallel make the model (torch's by default)."""
    torch.manual_seed(seed)
    ref = _Head(vocab)
    tp = _Head(vocab)
    tp.load_state_dict(ref.state_dict())
    api.parallelize_module(tp, _mesh(), {"out": api.ColwiseParallel(use_local_output=False)})
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    return tp, ref, x


def _labels(vocab, ignored=(), seed=2, shape=(BATCH, SEQ)):
    labels = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    for index in ignored:
        labels.view(-1)[index] = -100
    return labels


def _logits(vocab, seed=0):
    """(leaf DTensor [b, s, V] Shard(2), leaf unsharded [b, s, V]) from the model."""
    tp, ref, x = _models(vocab, seed)
    pred = tp(x)
    assert isinstance(pred, DTensor) and pred.placements == (Shard(2),), pred
    return pred.detach().requires_grad_(), ref(x).detach().requires_grad_()


def _grad_of(fn, leaf):
    leaf.grad = None
    loss = fn(leaf)
    loss.backward(torch.ones_like(loss))  # for "none" too: d sum / d logits
    return loss, leaf.grad


def _check_three_ways(dt, full, ours_fn, ref_fn, torch_ok=True):
    """ours_fn(dt) under loss_parallel vs ref_fn(full) and vs ours_fn(dt) under torch's."""
    with loss_parallel():
        loss, grad = _grad_of(ours_fn, dt)
    assert type(loss) is torch.Tensor, f"expected a plain tensor, got {type(loss).__name__}"
    assert isinstance(grad, DTensor) and grad.placements == dt.placements
    ref_loss, ref_grad = _grad_of(ref_fn, full)
    assert_close(loss, ref_loss.detach(), "loss vs unsharded", VS_UNSHARDED, equal_nan=True)
    assert_close(grad, ref_grad, "grad vs unsharded", VS_UNSHARDED, equal_nan=True)
    if torch_ok:
        with torch_loss_parallel():
            t_loss, t_grad = _grad_of(ours_fn, dt)
        assert_close(loss, t_loss.full_tensor().detach(), "loss vs torch's loss_parallel", VS_TORCH, equal_nan=True)
        assert_close(grad, t_grad.full_tensor(), "grad vs torch's loss_parallel", VS_TORCH, equal_nan=True)
    return loss


# ---------------------------------------------------------------- cross entropy


def _run_cross_entropy(vocab, reduction, ignored, torch_ok):
    dt, full = _logits(vocab)
    labels = _labels(vocab, ignored)

    def ce(logits):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), reduction=reduction)

    loss = _check_three_ways(dt, full, ce, ce, torch_ok)
    assert loss.shape == ((BATCH * SEQ,) if reduction == "none" else ())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignored", [(), (0, 3, 4)], ids=["all_labels", "some_ignored"])
def test_cross_entropy(ranks, world_size, reduction, ignored):
    """Flattened [b*s, V] logits, uneven vocab (10) on 3 and 4 ranks."""
    ranks(world_size).run(_run_cross_entropy, 10, reduction, ignored, True)


def _run_masked_classes():
    """Classes masked to -inf (a padded vocabulary's extra rows), so that on some rows one rank's whole
    shard is -inf: each rank sums exp against its own max (NOTE [vocab-parallel cross entropy]), which
    must not turn such a shard into nan. Against the unsharded loss and torch's loss_parallel."""
    vocab = 12  # over 3 ranks: 4, 4, 4 classes
    dt, full = _logits(vocab)
    mask = torch.zeros(BATCH, SEQ, vocab, dtype=torch.bool)
    mask[:, :2, 8:] = True  # the last rank's classes, on the first two positions
    mask[:, 3, :4] = True  # the first rank's, on another
    labels = _labels(vocab).masked_fill(mask[..., 8] & mask[..., 9], 0).masked_fill(mask[..., 0], 5)

    def ce(logits):
        return F.cross_entropy(logits.masked_fill(_like(logits, mask), float("-inf")).flatten(0, 1),
                               labels.flatten(0, 1))

    loss = _check_three_ways(dt, full, ce, ce)
    assert torch.isfinite(loss), loss


def _like(logits, mask):
    """The mask as the logits hold them: a DTensor with the same placements for a DTensor."""
    if isinstance(logits, DTensor):
        return distribute_tensor(mask, logits.device_mesh, logits.placements)
    return mask


def test_masked_classes(ranks):
    ranks(3).run(_run_masked_classes)


# Vocabularies whose rows are long: over 3 ranks 65536 classes a rank (a row of 256 KiB, the size of a core's
# L2 cache or more) and 262200 (past 1 MiB: the forward's second pass over a row comes from memory).
LARGE_VOCABS = {"256_KiB_rows": 3 * 65536, "1_MiB_rows": 3 * 262200}
LARGE_ROWS = 10


def _run_large_vocab(vocab):
    """Long rows through the fused kernels (each row's sum of exp in float blocks added in double), in
    float32 and bfloat16, with masked classes (one rank's whole shard -inf on a row) and an ignored row:
    the unsharded loss's value and gradient. float32 to VS_UNSHARDED; bfloat16 to 2**-8, one rounding of
    the loss and of each gradient element (the reference is the float64 loss of the same bfloat16 values)."""
    gen = torch.Generator().manual_seed(vocab)
    full = torch.randn(LARGE_ROWS, vocab, generator=gen) * 3
    full[1, : vocab // 3] = float("-inf")  # rank 0's classes
    full[2, vocab // 3:] = float("-inf")  # ranks 1 and 2's
    labels = torch.randint(vocab // 3, vocab, (LARGE_ROWS,), generator=gen)
    labels[2] = 7
    labels[5] = -100
    for dtype, tol in ((torch.float32, VS_UNSHARDED), (torch.bfloat16, 2 ** -8)):
        dt = distribute_tensor(full.to(dtype), _mesh(), [Shard(1)]).requires_grad_()
        ref = full.to(dtype).double().requires_grad_()
        with loss_parallel():
            loss, grad = _grad_of(lambda x: F.cross_entropy(x, labels), dt)
        ref_loss, ref_grad = _grad_of(lambda x: F.cross_entropy(x, labels), ref)
        assert loss.dtype == dtype and grad.dtype == dtype
        assert_close(loss, ref_loss.detach(), f"{dtype} loss, vocab {vocab}", tol)
        assert_close(grad, ref_grad, f"{dtype} grad, vocab {vocab}", tol)


@pytest.mark.parametrize("vocab", LARGE_VOCABS.values(), ids=LARGE_VOCABS.keys())
def test_large_vocab(ranks, vocab):
    ranks(3).run(_run_large_vocab, vocab)


def _run_float16(reduction):
    """float16 logits take the op's composition of ATen ops (the fused CPU kernels take float32 and
    bfloat16), the code other devices run: computed in float32, the loss and gradient rounded once
    to float16 (2**-10 of the largest magnitude), with an ignored row and a weight."""
    vocab = 10
    dt, full = _logits(vocab)
    dt = dt.detach().half().requires_grad_()
    full = full.detach().half().double().requires_grad_()
    labels = _labels(vocab, (3,)).flatten()
    weight = torch.rand(vocab, generator=torch.Generator().manual_seed(3))

    def ce(x):
        return F.cross_entropy(x.flatten(0, 1), labels, weight=weight.to(x.dtype), reduction=reduction)

    with loss_parallel():
        loss, grad = _grad_of(ce, dt)
    ref_loss, ref_grad = _grad_of(ce, full)
    assert loss.dtype == torch.float16 and grad.dtype == torch.float16
    assert_close(loss, ref_loss.detach(), "float16 loss", 2 ** -10)
    assert_close(grad, ref_grad, "float16 grad", 2 ** -10)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_float16(ranks, reduction):
    ranks(3).run(_run_float16, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_rank_without_classes(ranks, reduction):
    """5 classes on 4 ranks: torch.chunk gives 2, 2, 1, 0. (torch's loss_parallel
    fails on the empty rank with an IndexError and the others hang; not compared.)"""
    ranks(4).run(_run_cross_entropy, 5, reduction, (1,), False)


def _run_class_dim_1(reduction):
    """[b, V, s] (class dim 1, 3-D: aten's nll_loss2d) and [V] with a 0-d target."""
    vocab = 10
    dt, full = _logits(vocab)
    labels = _labels(vocab, (2,))

    def ce3(logits):
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction=reduction)

    loss = _check_three_ways(dt, full, ce3, ce3)
    assert loss.shape == ((BATCH, SEQ) if reduction == "none" else ())

    def ce1(logits):
        return F.cross_entropy(logits[1, 2], labels[1, 2], reduction=reduction)

    loss = _check_three_ways(dt, full, ce1, ce1)
    assert loss.shape == ()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_class_dim_1(ranks, world_size, reduction):
    ranks(world_size).run(_run_class_dim_1, reduction)


def _run_ignore_index():
    vocab = 10
    dt, full = _logits(vocab)
    labels = _labels(vocab).flatten()
    # an ignore_index that is a real class, held by one rank only
    ignore = int(labels[3])

    def ce(logits):
        return F.cross_entropy(logits.flatten(0, 1), labels, ignore_index=ignore)

    _check_three_ways(dt, full, ce, ce)

    # every label ignored: mean is 0/0 = nan, the gradient is 0 (as F.cross_entropy)
    none = torch.full_like(labels, -100)

    def ce_none(logits):
        return F.cross_entropy(logits.flatten(0, 1), none)

    loss = _check_three_ways(dt, full, ce_none, ce_none)
    assert loss.isnan()
    assert dt.grad.full_tensor().eq(0).all()


@pytest.mark.parametrize("world_size", [2, 3])
def test_ignore_index(ranks, world_size):
    ranks(world_size).run(_run_ignore_index)


def _run_weight(reduction, ignored):
    vocab = 10
    dt, full = _logits(vocab)
    labels = _labels(vocab, ignored).flatten()
    weight = torch.rand(vocab, generator=torch.Generator().manual_seed(5)) + 0.5
    for w in (weight, distribute_tensor(weight, _mesh(), [Replicate()])):
        def ce(logits, w=w):
            return F.cross_entropy(logits.flatten(0, 1), labels, weight=w, reduction=reduction)

        def ref(logits):
            return F.cross_entropy(logits.flatten(0, 1), labels, weight=weight, reduction=reduction)

        with loss_parallel():
            loss, grad = _grad_of(ce, dt)
        ref_loss, ref_grad = _grad_of(ref, full)
        assert_close(loss, ref_loss.detach(), "weighted loss vs unsharded", VS_UNSHARDED, equal_nan=True)
        assert_close(grad, ref_grad, "weighted grad vs unsharded", VS_UNSHARDED, equal_nan=True)
        if not ignored:
            # torch's backward with weight gathers weight[ignore_index] and
            # fails ("index -100 is out of bounds"): compared without ignored labels.
            with torch_loss_parallel():
                t_loss, t_grad = _grad_of(ce, dt)
            assert_close(loss, t_loss.full_tensor().detach(), "weighted loss vs torch", VS_TORCH, equal_nan=True)
            assert_close(grad, t_grad.full_tensor(), "weighted grad vs torch", VS_TORCH, equal_nan=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignored", [(), (1, 7)], ids=["all_labels", "some_ignored"])
def test_weight(ranks, reduction, ignored):
    ranks(3).run(_run_weight, reduction, ignored)


# ---------------------------------------------------------------- the model, end to end


def _run_model_end_to_end(flat_input):
    """nn.CrossEntropyLoss on the model output; parameter and input gradients
    against the unsharded model; backward outside the context; a Replicate
    DTensor target. ``flat_input``: the model takes [b * s, hidden], so the loss
    takes the DTensor torch_tp's linear handed back as it is (NOTE [DTensors
    handed between torch_tp modules]) made by torch_tp's ColwiseParallel."""
    vocab = 10
    tp, ref, x = _models(vocab, api=torch_tp if flat_input else torch.distributed.tensor.parallel)
    labels = _labels(vocab, (4,))
    if flat_input:
        x = x.flatten(0, 1)
    x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    criterion = nn.CrossEntropyLoss()
    target = distribute_tensor(labels.flatten(), _mesh(), [Replicate()])
    with loss_parallel():
        logits = tp(x_tp)
        loss = criterion(logits if flat_input else logits.flatten(0, 1), target)
    loss.backward()  # outside the context: torch's loss_parallel needs it inside
    ref_loss = criterion(ref(x_ref).flatten(0, x_ref.dim() - 2), labels.flatten())
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss", VS_UNSHARDED, equal_nan=True)
    assert_close(x_tp.grad, x_ref.grad, "grad x", VS_UNSHARDED, equal_nan=True)
    for (name, p), q in zip(tp.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad {name}", VS_UNSHARDED, equal_nan=True)
    assert abs(loss.item() - ref_loss.item()) <= VS_UNSHARDED * abs(ref_loss.item())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("flat_input", [False, True])
def test_model_end_to_end(ranks, world_size, flat_input):
    ranks(world_size).run(_run_model_end_to_end, flat_input)


def _run_handed_logits_reshaped():
    """NOTE [reshaping the leading dims of a handed DTensor]: the logits torch_tp's ColwiseParallel
    hands back, reshaped the ways losses reshape them, stay handed DTensors sharded on the class dim
    (no DTensor dispatch) that loss_parallel's kernels take as they are (no twin), and the loss and
    every gradient match the unsharded model's. Reshapes that
    touch the class dim go through DTensor and still give its values."""
    from torch_tp.parallel._layout import HandedDTensor

    vocab = 10  # over 3 ranks: 4, 4, 2 classes
    tp, ref, x = _models(vocab, api=torch_tp)
    labels = _labels(vocab, (4,)).flatten()
    reshapes = {
        "flatten(0, 1)": lambda t: t.flatten(0, 1),
        "torch.flatten(t, 0, -2)": lambda t: torch.flatten(t, 0, -2),
        "view(-1, V)": lambda t: t.view(-1, vocab),
        "reshape((b * s, V))": lambda t: t.reshape((BATCH * SEQ, vocab)),
        "torch.reshape(t, (-1, V)).float()": lambda t: torch.reshape(t, (-1, vocab)).float(),
        # the example model's logits.to(promote_types(dtype, float32)), then a loss in float64
        "to(float32).flatten(0, 1).to(float64)": lambda t: t.to(torch.float32).flatten(0, 1).to(torch.float64),
    }
    losses = {"cross_entropy": F.cross_entropy,
              "nll_loss(log_softmax)": lambda logits, target: F.nll_loss(F.log_softmax(logits, -1), target)}
    for (name, reshape), (loss_name, loss_fn) in itertools.product(reshapes.items(), losses.items()):
        name = f"{loss_name} of {name}"
        x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        tp.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        with loss_parallel():
            logits = reshape(tp(x_tp))
            assert type(logits) is HandedDTensor, (name, type(logits))
            assert logits.shape == (BATCH * SEQ, vocab) and logits.placements == (Shard(1),), (name, logits)
            loss = loss_fn(logits, labels)
            # The kernels took the handed DTensor itself: no differentiable twin was made for them.
            assert logits._tp_twin is None, name
        loss.backward()
        ref_loss = loss_fn(reshape(ref(x_ref)), labels)
        ref_loss.backward()
        assert_close(loss, ref_loss.detach(), f"{name}: loss", VS_UNSHARDED)
        assert_close(x_tp.grad, x_ref.grad, f"{name}: grad x", VS_UNSHARDED)
        for (param_name, p), q in zip(tp.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, f"{name}: grad {param_name}", VS_UNSHARDED)

    logits = tp(x)
    # float32 already: Tensor.float() and Tensor.to(float32) return the tensor itself
    assert logits.float() is logits and logits.to(torch.float32) is logits
    full = ref(x).detach()
    # The class dim merged: DTensor's own ops, values as torch computes them.
    for name, reshape in {"flatten()": lambda t: t.flatten(), "flatten(1, 2)": lambda t: t.flatten(1, 2)}.items():
        out = reshape(logits)
        assert type(out) is not HandedDTensor, name
        assert_close(out.full_tensor(), reshape(full), name, VS_UNSHARDED)


@pytest.mark.parametrize("world_size", [1, 3])
def test_handed_logits_reshaped(ranks, world_size):
    ranks(world_size).run(_run_handed_logits_reshaped)


# ---------------------------------------------------------------- communication


class _CountCollectives(TorchDispatchMode):
    """The calls that communicate: torch's collectives and the torch_tp ops that do (a torch_tp op
    that computes a loss may communicate inside its kernel, where no mode sees the collective)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") or \
                (func.namespace == "torch_tp" and func.name().split("::")[1] in _COMMUNICATING_OPS):
            self.calls.append(func.name())
        return func(*args, **(kwargs or {}))


def _run_communication():
    vocab = 10
    dt, _ = _logits(vocab)
    labels = _labels(vocab, (0,)).flatten()
    counts = {}
    cases = {
        "cross_entropy": lambda x: F.cross_entropy(x, labels),
        "log_softmax+nll_loss": lambda x: F.nll_loss(F.log_softmax(x, -1), labels),
        "nll_loss": lambda x: F.nll_loss(x, labels),
        "log_softmax": lambda x: F.log_softmax(x, 1).sum(),
    }
    for name, fn in cases.items():
        logits = dt.detach().flatten(0, 1).requires_grad_()
        with loss_parallel(), _CountCollectives() as fwd:
            loss = fn(logits)
        with _CountCollectives() as bwd:
            loss.backward()
        counts[name] = (len(fwd.calls), len(bwd.calls))
    assert counts == {
        "cross_entropy": (1, 0),          # its forward all-gathers [max, sum exp, target logit]
        "log_softmax+nll_loss": (3, 0),   # max, sum exp; target logp (fused backward)
        "nll_loss": (1, 0),
        "log_softmax": (2, 1),            # backward: sum of the gradient over classes
    }, counts


def test_communication(ranks):
    """Collectives per call: none in backward for the losses."""
    ranks(2).run(_run_communication)


# ---------------------------------------------------------------- log_softmax and nll_loss


def _run_log_softmax_nll(reduction):
    vocab = 10
    dt, full = _logits(vocab)
    labels = _labels(vocab, (3,)).flatten()

    def nll_of_log_softmax(logits):  # NOTE [log_softmax then nll_loss]
        return F.nll_loss(F.log_softmax(logits.flatten(0, 1), -1), labels, reduction=reduction)

    _check_three_ways(dt, full, nll_of_log_softmax, nll_of_log_softmax)

    def method(logits):  # Tensor.log_softmax, torch.log_softmax, nn.NLLLoss
        return nn.NLLLoss(reduction=reduction)(torch.log_softmax(logits, 2).flatten(0, 1), labels) \
            + F.nll_loss(logits.flatten(0, 1).log_softmax(1), labels, reduction=reduction)

    _check_three_ways(dt, full, method, method, torch_ok=False)

    # Used other ways, torch's loss_parallel gets these gradients wrong (its
    # log_softmax backward is the identity, its nll_loss backward adds exp(x)):
    # compare with the unsharded reference only.
    def log_softmax_alone(logits):
        lp = F.log_softmax(logits, -1)
        out = (lp * lp).sum() + lp[..., :3].sum() * 0.5  # the grad of lp is not 1-hot
        return out.full_tensor() if isinstance(out, DTensor) else out

    _check_three_ways(dt, full, log_softmax_alone, log_softmax_alone, torch_ok=False)

    def nll_of_logits(logits):
        return F.nll_loss(logits.flatten(0, 1), labels, reduction=reduction)

    _check_three_ways(dt, full, nll_of_logits, nll_of_logits, torch_ok=False)

    def modified_in_place(logits):  # the fused path must not be taken
        lp = F.log_softmax(logits.flatten(0, 1), -1)
        lp.mul_(2)
        return F.nll_loss(lp, labels, reduction=reduction)

    def modified_ref(logits):
        return F.nll_loss(F.log_softmax(logits.flatten(0, 1), -1) * 2, labels, reduction=reduction)

    with loss_parallel():
        loss, grad = _grad_of(modified_in_place, dt)
    ref_loss, ref_grad = _grad_of(modified_ref, full)
    assert_close(loss, ref_loss.detach(), "in-place modified log_softmax loss", VS_UNSHARDED, equal_nan=True)
    assert_close(grad, ref_grad, "in-place modified log_softmax grad", VS_UNSHARDED, equal_nan=True)

    with loss_parallel():
        lp = F.log_softmax(dt, -1)
    assert isinstance(lp, DTensor) and lp.placements == (Shard(2),)
    assert_close(lp, F.log_softmax(full, -1).detach(), "log_softmax value", VS_UNSHARDED, equal_nan=True)


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_log_softmax_nll_loss(ranks, world_size, reduction):
    ranks(world_size).run(_run_log_softmax_nll, reduction)


def _run_bfloat16():
    """bf16 logits: computed in fp32, the loss rounded once to bf16."""
    vocab = 10
    dt, full = _logits(vocab)
    dt = dt.detach().bfloat16().requires_grad_()
    full = full.detach().bfloat16().float().requires_grad_()
    labels = _labels(vocab).flatten()
    with loss_parallel():
        loss, grad = _grad_of(lambda x: F.cross_entropy(x.flatten(0, 1), labels), dt)
    ref_loss, ref_grad = _grad_of(lambda x: F.cross_entropy(x.flatten(0, 1), labels), full)
    assert loss.dtype == torch.bfloat16 and grad.dtype == torch.bfloat16
    assert_close(loss.float(), ref_loss.detach(), "bf16 loss", 2 ** -8, equal_nan=True)  # one bf16 rounding
    assert_close(grad.full_tensor().float(), ref_grad, "bf16 grad", 2 ** -8, equal_nan=True)


def test_bfloat16(ranks):
    ranks(2).run(_run_bfloat16)


# ---------------------------------------------------------------- errors


def _expect(exc, match, fn):
    with pytest.raises(exc, match=match):
        with loss_parallel():
            fn()


def _run_errors():
    vocab = 10
    dt, _ = _logits(vocab)
    flat = dt.flatten(0, 1)
    labels = _labels(vocab).flatten()
    _expect(NotImplementedError, r"loss_parallel: cross_entropy: label_smoothing=0.1",
            lambda: F.cross_entropy(flat, labels, label_smoothing=0.1))
    # [b, s, V] without flattening: the class dim of cross_entropy is 1
    _expect(ValueError, r"loss_parallel: cross_entropy: input must be sharded on its class dim 1.*"
            r"Shard\(dim=2\).*flatten", lambda: F.cross_entropy(dt, labels.view(BATCH, SEQ)))
    _expect(ValueError, r"loss_parallel: cross_entropy: input must be sharded on its class dim 1.*Replicate",
            lambda: F.cross_entropy(flat.redistribute(_mesh(), [Replicate()]), labels))
    _expect(ValueError, r"loss_parallel: log_softmax: input must be sharded on its class dim 0.*Shard\(dim=1\)",
            lambda: F.log_softmax(flat, 0))
    _expect(NotImplementedError, r"loss_parallel: cross_entropy: target of dtype torch.float32 \(class prob",
            lambda: F.cross_entropy(flat, torch.softmax(torch.randn(BATCH * SEQ, vocab), -1)))
    _expect(ValueError, r"loss_parallel: nll_loss: target.shape=\(9,\) does not match input.shape=\(10, 10\)",
            lambda: F.nll_loss(flat, labels[:9]))
    _expect(RuntimeError, r"torch_tp::vocab_parallel_cross_entropy: a target is outside \[0, 10\)",
            lambda: F.cross_entropy(flat, labels.clamp(max=9) + 1))
    _expect(ValueError, r"loss_parallel: cross_entropy: reduction='avg' is not one of",
            lambda: F.cross_entropy(flat, labels, reduction="avg"))
    _expect(ValueError, r"loss_parallel: cross_entropy: weight.shape=\(9,\) must be \(10,\)",
            lambda: F.cross_entropy(flat, labels, weight=torch.ones(9)))
    _expect(RuntimeError, r"loss_parallel: cross_entropy: weight requires grad",
            lambda: F.cross_entropy(flat, labels, weight=torch.ones(vocab, requires_grad=True)))
    if dist.get_world_size() > 1:
        sharded = distribute_tensor(labels, _mesh(), [Shard(0)])
        _expect(ValueError, r"loss_parallel: cross_entropy: target must be a plain tensor or a DTensor "
                r"replicated", lambda: F.cross_entropy(flat, sharded))
    if dist.get_world_size() == 4:
        mesh2d = init_device_mesh("cpu", (2, 2))
        x2d = distribute_tensor(torch.randn(4, vocab), mesh2d, [Shard(0), Shard(1)])
        _expect(ValueError, r"loss_parallel: cross_entropy: target must be a DTensor on the input's mesh with "
                r"placements \(Shard\(dim=0\), Replicate\(\)\)", lambda: F.cross_entropy(x2d, labels[:4]))
        t2d = distribute_tensor(labels[:4].clamp(0, vocab - 1), mesh2d, [Shard(0), Replicate()])
        _expect(NotImplementedError, r"loss_parallel: cross_entropy: reduction='mean' on a 2-D DeviceMesh",
                lambda: F.cross_entropy(x2d, t2d))
        both = distribute_tensor(torch.randn(4, vocab), mesh2d, [Shard(1), Shard(1)])
        _expect(ValueError, r"loss_parallel: cross_entropy: input must be sharded on its class dim 1 by "
                r"exactly one mesh dim", lambda: F.cross_entropy(both, labels[:4], reduction="sum"))


@pytest.mark.parametrize("world_size", [1, 4])
def test_errors(ranks, world_size):
    ranks(world_size).run(_run_errors)


def _raised(ctx, fn):
    """The exception ``fn`` raises inside ``ctx()``, caught inside it: torch's loss_parallel
    leaves its handlers registered when an exception leaves the context."""
    with ctx():
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (compared with the other library's)
            return e
    raise AssertionError("no exception")


def _run_errors_like_torch(mesh_ndim):
    """Where torch's loss_parallel refuses an input, torch_tp's raises the same exception type, and
    its message holds the words torch's own tests match (test_tp_examples.py's assertRaisesRegex),
    so code written against torch's errors keeps working."""
    vocab = 16
    x = torch.randn(8, vocab, generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(5))
    if mesh_ndim == 1:
        cases = [
            ("batch-sharded input on a 1-D mesh", "loss_parallel",
             lambda: F.cross_entropy(distribute_tensor(x, _mesh(), [Shard(0)]), labels)),
        ]
    else:
        mesh2d = init_device_mesh("cpu", (2, 2))
        x2d = distribute_tensor(x, mesh2d, [Shard(0), Shard(1)])
        t2d = distribute_tensor(labels, mesh2d, [Shard(0), Replicate()])
        partial_on_dp = DTensor.from_local(x2d.to_local(), mesh2d, [Partial(), Shard(1)], run_check=False)
        cases = [
            ("Partial on the other mesh dim", "Shard or Replicate",
             lambda: F.cross_entropy(partial_on_dp, t2d, reduction="sum")),
            ("plain target with a batch-sharded mesh dim", "requires a DTensor",
             lambda: F.cross_entropy(x2d, labels, reduction="sum")),
            ("reduction='mean' on a 2-D mesh", "one-dimensional", lambda: F.cross_entropy(x2d, t2d)),
        ]
    for what, words, fn in cases:
        theirs, ours = _raised(torch_loss_parallel, fn), _raised(loss_parallel, fn)
        assert type(ours) is type(theirs), f"{what}: torch_tp raised {ours!r}, torch {theirs!r}"
        assert re.search(words, str(theirs)), f"{what}: torch's message no longer says {words!r}: {theirs}"
        assert re.search(words, str(ours)), f"{what}: torch_tp's message lacks {words!r}: {ours}"


@pytest.mark.parametrize("mesh_ndim", [1, pytest.param(2, marks=needs_torch_2d_loss_parallel)])
def test_errors_like_torch(ranks, mesh_ndim):
    ranks(4).run(_run_errors_like_torch, mesh_ndim)


# ---------------------------------------------------------------- the op itself


def _op_case(vocab, dtype=torch.float32):
    """(this rank's logits [2, 3, n_r] leaf, its target, the unsharded logits leaf [2, 3, vocab])."""
    gen = torch.Generator().manual_seed(vocab)
    full = (torch.randn(2, 3, vocab, generator=gen) * 3).to(dtype)
    target = torch.randint(0, vocab, (2, 3), generator=gen)
    target[0, 1] = -100
    start, length = torch_tp.ops.chunk_range(vocab, dist.get_world_size(), dist.get_rank())
    return full[..., start:start + length].clone().requires_grad_(), target, full.double().requires_grad_()


def _run_op(vocab):
    """torch_tp.ops.vocab_parallel_cross_entropy on this rank's piece of [2, 3, vocab] logits, for each
    reduction, with and without a weight: the unsharded F.cross_entropy's loss and this rank's columns of
    its gradient (VS_UNSHARDED)."""
    group = dist.group.WORLD
    weight = torch.rand(vocab, generator=torch.Generator().manual_seed(5)) + 0.5
    for reduction, w in itertools.product(REDUCTIONS, (None, weight)):
        local, target, full = _op_case(vocab)
        loss = torch_tp.ops.vocab_parallel_cross_entropy(local, target, group, vocab, w, reduction=reduction)
        ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), None if w is None else w.double(),
                              reduction=reduction)
        ref = ref.view(2, 3) if reduction == "none" else ref
        loss.backward(torch.ones_like(loss))
        ref.backward(torch.ones_like(ref))
        start, length = torch_tp.ops.chunk_range(vocab, dist.get_world_size(), dist.get_rank())
        what = f"{reduction}, weight {w is not None}"
        assert_close(loss, ref.detach(), f"loss ({what})", VS_UNSHARDED)
        assert_close(local.grad, full.grad[..., start:start + length], f"grad ({what})", VS_UNSHARDED)


@pytest.mark.parametrize("world_size", [1, 3])
def test_op(ranks, world_size):
    ranks(world_size).run(_run_op, 10)


def _run_op_opcheck_and_compile():
    """opcheck of the op and its pieces (schemas, Meta kernels, autograd registration), and the op under
    torch.compile(fullgraph=True), forward and backward: the eager loss and gradient."""
    name = dist.group.WORLD.group_name
    vocab = 10
    local, target, _ = _op_case(vocab)
    weight = torch.rand(vocab, generator=torch.Generator().manual_seed(5))
    for reduction in REDUCTIONS:
        torch.library.opcheck(torch.ops.torch_tp.vocab_parallel_cross_entropy.default,
                              (local, target, name, vocab, weight, -100, reduction))
        loss, m, s, w = torch.ops.torch_tp._vocab_parallel_cross_entropy_forward(
            local.detach(), target, name, vocab, weight, -100, reduction)
        torch.library.opcheck(torch.ops.torch_tp._vocab_parallel_cross_entropy_forward.default,
                              (local.detach(), target, name, vocab, weight, -100, reduction))
        torch.library.opcheck(torch.ops.torch_tp._vocab_parallel_cross_entropy_backward.default,
                              (torch.ones_like(loss), local.detach(), target, m, s, w, name, vocab, reduction))

    def fn(x):
        return torch.ops.torch_tp.vocab_parallel_cross_entropy(x * 2, target, name, vocab, weight)

    results = []
    torch._dynamo.reset()
    for f in (fn, torch.compile(fn, fullgraph=True)):
        x = local.detach().clone().requires_grad_()
        loss = f(x)
        loss.backward()
        results.append((loss.detach(), x.grad))
    assert_close(results[1][0], results[0][0], "compiled loss", VS_TORCH)
    assert_close(results[1][1], results[0][1], "compiled grad", VS_TORCH)


@pytest.mark.parametrize("world_size", [1, 2])
def test_op_opcheck_and_compile(ranks, world_size):
    ranks(world_size).run(_run_op_opcheck_and_compile, timeout=300)


def _run_op_errors():
    """Bad arguments name the op, the argument and the value."""
    name = dist.group.WORLD.group_name
    op = torch.ops.torch_tp.vocab_parallel_cross_entropy
    x, t = torch.randn(4, 5), torch.zeros(4, dtype=torch.long)  # rank 0 of 2 holds 5 of 10 classes
    cases = [
        # 12 classes give every rank 6: each rank raises (a mismatch on one rank alone would leave the
        # others in the all-gather until the group's timeout, as any collective with a missing peer).
        (lambda: op(x, t, name, 12), ["vocab_parallel_cross_entropy", "holds 5 classes", "num_classes=12"]),
        (lambda: op(x, t.int(), name, 10), ["vocab_parallel_cross_entropy", "target has dtype Int", "int64"]),
        (lambda: op(x, t[:3], name, 10), ["vocab_parallel_cross_entropy", "target has shape [3]", "[4]"]),
        (lambda: op(x.long(), t, name, 10), ["vocab_parallel_cross_entropy", "logits has dtype Long"]),
        (lambda: op(x, t, name, 10, torch.ones(9)), ["vocab_parallel_cross_entropy", "weight has shape [9]"]),
        (lambda: op(x, t, name, 10, reduction="avg"), ["vocab_parallel_cross_entropy", "reduction='avg'"]),
        (lambda: op(x, t, "no_such_group", 10), ["vocab_parallel_cross_entropy", "group_name='no_such_group'"]),
        (lambda: op(x, t - 1, name, 10, ignore_index=0),
         ["vocab_parallel_cross_entropy", "outside [0, 10)", "ignore_index=0", "target -1 in row 0"]),
        (lambda: op(x.requires_grad_(), t, name, 10, torch.ones(10, requires_grad=True)),
         ["vocab_parallel_cross_entropy", "weight requires grad"]),
    ]
    for fn, words in cases:
        assert_error_names(fn, words)


def test_op_errors(ranks):
    ranks(2).run(_run_op_errors)


# ---------------------------------------------------------------- a 2-D mesh


# (input shape, input placements on a (2, 2) mesh), torch's documented cases: the classes
# on one mesh dim, a batch (or sequence) dim on the other.
CASES_2D = [
    ((8, 10), (Shard(0), Shard(1))),
    ((8, 10), (Replicate(), Shard(1))),
    ((4, 10, 6), (Shard(2), Shard(1))),
    ((4, 10, 6), (Shard(0), Shard(1))),
    ((8, 10), (Shard(1), Shard(0))),  # the classes on mesh dim 0
]


def _run_2d(against_torch):
    """NOTE [loss_parallel on a multi-dimensional mesh]: cross_entropy, log_softmax + nll_loss
    with reduction "sum" and "none" give the NOTE's placements and the unsharded
    F.cross_entropy's values and input gradients (VS_UNSHARDED); with ``against_torch``, torch's
    loss_parallel gives the same placements and values."""
    mesh = init_device_mesh("cpu", (2, 2))
    gen = torch.Generator().manual_seed(3)
    for shape, placements in CASES_2D:
        full = torch.randn(*shape, generator=gen)
        labels = torch.randint(0, shape[1], shape[:1] + shape[2:], generator=gen)
        labels.view(-1)[1] = -100  # an ignored row
        class_mesh_dim = next(i for i, p in enumerate(placements) if p == Shard(1))
        target_placements = tuple(
            Replicate() if i == class_mesh_dim or not isinstance(p, Shard) else Shard(p.dim - (p.dim > 1))
            for i, p in enumerate(placements))
        for reduction in ("sum", "none"):
            for how in ("cross_entropy", "log_softmax+nll_loss"):
                def loss_of(x, t, ctx):
                    with ctx():
                        if how == "cross_entropy":
                            return F.cross_entropy(x, t, reduction=reduction)
                        return F.nll_loss(F.log_softmax(x, 1), t, reduction=reduction)

                what = f"{shape} {placements} {reduction} {how}"
                ref_x = full.clone().requires_grad_()
                expected = loss_of(ref_x, labels, torch.enable_grad)
                expected.sum().backward()
                results = {}
                contexts = [("torch_tp", loss_parallel)] + ([("torch", torch_loss_parallel)] if against_torch else [])
                for name, ctx in contexts:
                    x = distribute_tensor(full, mesh, placements).requires_grad_()
                    t = distribute_tensor(labels, mesh, target_placements)
                    out = loss_of(x, t, ctx)
                    with ctx():
                        out.sum().backward()
                    results[name] = out
                    assert_close(out, expected, f"{what}: {name} loss", VS_UNSHARDED, equal_nan=True)
                    assert_close(x.grad, ref_x.grad, f"{what}: {name} grad", VS_UNSHARDED, equal_nan=True)
                ours = results["torch_tp"]
                if reduction == "none":  # sharded like the target
                    expected_placements, expected_shape = target_placements, labels.shape
                else:  # summed over the classes' mesh dim, each batch-sharded mesh dim summed its own rows
                    expected_placements = tuple(
                        Replicate() if i == class_mesh_dim else Partial() if isinstance(p, Shard) else Replicate()
                        for i, p in enumerate(placements))
                    expected_shape = torch.Size()
                assert ours.placements == expected_placements, f"{what}: {ours.placements}"
                assert ours.shape == expected_shape, f"{what}: {ours.shape}"
                if against_torch:
                    theirs = results["torch"]
                    assert ours.placements == theirs.placements, f"{what}: {ours.placements} vs {theirs.placements}"
                    assert ours.shape == theirs.shape, f"{what}: {ours.shape} vs {theirs.shape}"


def test_2d_mesh(ranks):
    ranks(4).run(_run_2d, False, timeout=300)


@needs_torch_2d_loss_parallel
def test_2d_mesh_matches_torch(ranks):
    ranks(4).run(_run_2d, True, timeout=300)


# ---------------------------------------------------------------- plain tensors and the context


def test_plain_tensors_unchanged():
    """Inside the context, the functions on plain tensors give bitwise the same
    values and gradients (the mode passes them through)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 7, generator=gen)
    labels = torch.tensor([0, 6, -100, 3, 3, 1])
    weight = torch.rand(7, generator=gen)
    cases = [
        lambda x: F.cross_entropy(x, labels),
        lambda x: F.cross_entropy(x, labels, weight=weight, reduction="sum", label_smoothing=0.2),
        lambda x: F.cross_entropy(x, torch.softmax(torch.ones(6, 7), -1)),
        lambda x: F.nll_loss(F.log_softmax(x, 1), labels, reduction="none").sum(),
        lambda x: x.log_softmax(-1).sum() + torch.log_softmax(x, 0).mean() + nn.CrossEntropyLoss()(x, labels),
    ]
    for case in cases:
        outside = logits.clone().requires_grad_()
        expected = case(outside)
        expected.backward()
        inside = logits.clone().requires_grad_()
        with loss_parallel():
            actual = case(inside)
            actual.backward()
        assert torch.equal(actual, expected)
        assert torch.equal(inside.grad, outside.grad)


def test_context_nests_and_survives_exceptions():
    """Unlike torch's (whose exit after an exception is skipped, and whose
    nested exit raises KeyError), the context leaves no state behind: DTensor's
    torch functions are off again once the outermost context exits, however it
    exits, and stay on until then."""
    disabled = torch._C._disabled_torch_function_impl
    assert DTensor.__torch_function__ is disabled
    with loss_parallel():
        with loss_parallel():
            assert DTensor.__torch_function__ is not disabled
        assert DTensor.__torch_function__ is not disabled
    assert DTensor.__torch_function__ is disabled
    with pytest.raises(KeyError):
        with loss_parallel():
            raise KeyError("inside")
    assert DTensor.__torch_function__ is disabled
