"""torch_tp.parallel.checkpoint against the unsharded model.

The models are test_parallelize's Transformer (nn.Embedding, nn.Linear,
nn.LayerNorm) parallelized by torch_tp.parallelize_module with its
_transformer_plan, plain tensor parallel or sequence parallel (Colwise,
Rowwise, SequenceParallel, PrepareModuleInput). The vocabulary, 31, splits
unevenly over 2, 3 and 4 ranks (16+15, 11+11+9, 8+8+8+7); a vocabulary of
world_size + 1 leaves the last rank with no rows at all at 3 and 4 ranks.

Tolerances:

- State dicts are compared bitwise (torch.equal): gathering and loading only
  move data.
- clip_grad_norm_'s total norm: NORM_RTOL = 1e-6 of torch.nn.utils.clip_grad_norm_
  on the unsharded reference. The p-norm is a float32 sum of |g|^p that
  torch_tp adds up in another order (per shard, then over ranks) than torch
  (per tensor), and raises to 1/p in another way; each is within a few float32
  ulps (6e-8) of the exact value (measured: <= 1.9e-7). After each model's own
  backward the gradients themselves also differ by the sharded GEMMs' roundoff,
  but a norm over thousands of elements averages that out (measured: <= 2.2e-7
  at 1 to 4 ranks), so the same bound holds. The inf-norm is a max, exact in
  any order: on identical gradients it is compared bitwise.
- Clipped gradients, when both clip the same gradients (the parallel model's
  set to the exact shards of the reference's): elementwise within NORM_RTOL,
  since both scale by max_norm / (total + 1e-6) with totals that agree that
  closely (bitwise for the inf-norm). After each model's own backward:
  BACKWARD_RTOL = 1e-5 of each tensor's largest magnitude, the bound
  test_parallelize holds the unclipped gradients to.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import torch_tp
from torch_tp.parallel.checkpoint import clip_grad_norm_, get_full_state_dict, load_full_state_dict

from _compare import assert_close
from test_parallelize import SCALE_FLOOR, Transformer, _transformer_plan

NORM_RTOL = 1e-6
BACKWARD_RTOL = 1e-5
SEQ = 12  # divisible by 1 to 4: sequence shards are even, as DTensor.from_local assumes

WORLD_SIZES = [1, 2, 3, 4]


def _models(sequence_parallel, vocab=31, tied=False, seed=0):
    """(unsharded reference, the same weights parallelized by torch_tp)."""
    torch.manual_seed(seed)
    reference = Transformer(vocab=vocab, tied=tied)
    parallel = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch_tp.parallelize_module(parallel, mesh, _transformer_plan(torch_tp, sequence_parallel))
    if tied:
        # parallelize_module gives each module its own new Parameter; tie them
        # again (both are the [vocab, dim] table sharded on dim 0, i.e. Shard(0)).
        parallel.output.weight = parallel.tok_embeddings.weight
    return reference, parallel


def _ids(vocab, step=0):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _loss(out):
    return out.square().sum() / out.numel()


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def _assert_state_dicts_equal(actual, expected, what):
    """Same keys, and bitwise the same tensors (DTensors: the same local pieces)."""
    assert list(actual) == list(expected), f"{what}: keys {list(actual)} != {list(expected)}"
    for key, value in expected.items():
        got, value = _local(actual[key]), _local(value)
        assert got.shape == value.shape, f"{what}: {key} shape {tuple(got.shape)} != {tuple(value.shape)}"
        assert got.dtype == value.dtype, f"{what}: {key} dtype {got.dtype} != {value.dtype}"
        assert torch.equal(got, value), f"{what}: {key} differs by {(got - value).abs().max().item():.3e}"


# ---------------------------------------------------------------- get_full_state_dict


def _check_get_full_state_dict(sequence_parallel, vocab, tied):
    reference, parallel = _models(sequence_parallel, vocab, tied)
    expected = reference.state_dict()
    sharded = [k for k, v in parallel.state_dict(keep_vars=True).items()
               if isinstance(v, DTensor) and isinstance(v.placements[0], Shard)]
    if dist.get_world_size() > 1:
        assert "tok_embeddings.weight" in sharded and "layers.0.feed_forward.w2.weight" in sharded

    full = get_full_state_dict(parallel)
    _assert_state_dicts_equal(full, expected, "get_full_state_dict")
    for key, value in full.items():
        assert not value.requires_grad, key
    # A snapshot, not a view: training the model afterwards leaves it alone.
    assert full["norm.weight"].data_ptr() != _local(parallel.norm.weight).data_ptr()
    if tied:
        assert full["output.weight"] is full["tok_embeddings.weight"], "a tied parameter is gathered once"
    # The unsharded model takes it as its own state dict.
    fresh = Transformer(vocab=vocab, tied=tied)
    fresh.load_state_dict(full)
    _assert_state_dicts_equal(fresh.state_dict(), expected, "unsharded model loaded from it")

    only = get_full_state_dict(parallel, rank0_only=True)
    if dist.get_rank() == 0:
        _assert_state_dicts_equal(only, expected, "rank0_only on rank 0")
    else:
        assert only == {}, f"rank0_only: rank {dist.get_rank()} got {len(only)} entries"
    return len(full)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_get_full_state_dict_is_the_unsharded_state_dict(ranks, world_size):
    pool = ranks(world_size)
    for sequence_parallel in (False, True):
        pool.run(_check_get_full_state_dict, sequence_parallel, 31, False, timeout=300)
    pool.run(_check_get_full_state_dict, False, 31, True, timeout=300)


@pytest.mark.parametrize("world_size", [3, 4])
def test_get_full_state_dict_with_empty_shards(ranks, world_size):
    # vocab = world_size + 1: torch.chunk leaves the last rank no rows.
    ranks(world_size).run(_check_get_full_state_dict, True, world_size + 1, False, timeout=300)


# ---------------------------------------------------------------- load_full_state_dict


def _trained_state_dict(reference, vocab, steps=3):
    """The reference after a few SGD steps; rank 0's values on every rank."""
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        _loss(reference(_ids(vocab, step))).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = reference.state_dict()
    for value in state.values():
        dist.broadcast(value, 0)
    return state


def _check_load_full_state_dict(sequence_parallel, vocab):
    reference, _ = _models(sequence_parallel, vocab)
    state = _trained_state_dict(reference, vocab)
    _, fresh = _models(sequence_parallel, vocab, seed=1)  # other weights
    before = {name: (param, _local(param).data_ptr()) for name, param in fresh.named_parameters()}
    optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)

    result = load_full_state_dict(fresh, state)
    assert result.missing_keys == [] and result.unexpected_keys == []

    local = fresh.state_dict(keep_vars=True)
    for key, value in state.items():
        expected = _local_piece(local[key], value)
        assert torch.equal(_local(local[key]).detach(), expected), f"{key}: not this rank's piece of the loaded tensor"
    # In place: the same Parameter objects and storage, which the optimizer holds.
    for name, param in fresh.named_parameters():
        assert param is before[name][0] and _local(param).data_ptr() == before[name][1], name
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], fresh.parameters()))

    _assert_state_dicts_equal(get_full_state_dict(fresh), state, "get_full_state_dict(load_full_state_dict(sd))")

    # The loaded model computes what the reference computes.
    ids = _ids(vocab, 7)
    expected_out, out = reference(ids), fresh(ids)
    error = ((out - expected_out).abs().max() / expected_out.abs().max()).item()
    assert error <= BACKWARD_RTOL, f"output of the loaded model: relative error {error:.2e}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_load_full_state_dict_round_trip(ranks, world_size):
    pool = ranks(world_size)
    for sequence_parallel in (False, True):
        pool.run(_check_load_full_state_dict, sequence_parallel, 31, timeout=300)


@pytest.mark.parametrize("world_size", [3, 4])
def test_load_full_state_dict_with_empty_shards(ranks, world_size):
    ranks(world_size).run(_check_load_full_state_dict, True, world_size + 1, timeout=300)


def _check_load_errors():
    reference, parallel = _models(False)
    state = reference.state_dict()
    snapshot = {k: _local(v).clone() for k, v in parallel.state_dict().items()}
    other = Transformer(vocab=31).state_dict()  # other values, to see that nothing gets copied

    def expect_error(bad, *needles, strict=True):
        with pytest.raises(RuntimeError) as caught:
            load_full_state_dict(parallel, bad, strict=strict)
        message = str(caught.value)
        for needle in ("torch_tp.load_full_state_dict",) + needles:
            assert needle in message, f"{needle!r} not in {message!r}"
        # Checked before anything is copied.
        _assert_state_dicts_equal(parallel.state_dict(), snapshot, "after a failed load")

    missing = copy.copy(other)
    del missing["layers.1.attention.wq.weight"]
    expect_error(missing, "missing key", "'layers.1.attention.wq.weight'")

    unexpected = copy.copy(other)
    unexpected["layers.1.attention.extra"] = torch.zeros(3)
    expect_error(unexpected, "unexpected key", "'layers.1.attention.extra'")

    # A sharded parameter: checked against the full shape, not the local piece's.
    wrong = copy.copy(other)
    wrong["tok_embeddings.weight"] = torch.zeros(32, 24)
    expect_error(wrong, "size mismatch", "'tok_embeddings.weight'", "(32, 24)", "(31, 24)", "Shard(dim=0) on DeviceMesh")
    # A replicated one (bias of a row-parallel layer), even without strict.
    wrong = copy.copy(other)
    wrong["layers.0.feed_forward.w2.bias"] = torch.zeros(25)
    expect_error(wrong, "size mismatch", "'layers.0.feed_forward.w2.bias'", "(25,)", "(24,)", strict=False)

    not_tensor = copy.copy(other)
    not_tensor["norm.weight"] = [1.0] * 24
    expect_error(not_tensor, "'norm.weight'", "list")

    # strict=False: missing keys are left alone, unexpected ones reported.
    partial = {k: v for k, v in state.items() if k != "output.weight"}
    partial["extra"] = torch.zeros(1)
    result = load_full_state_dict(parallel, partial, strict=False)
    assert result.missing_keys == ["output.weight"] and result.unexpected_keys == ["extra"], result
    assert torch.equal(_local(parallel.output.weight).detach(), snapshot["output.weight"])
    # A DTensor state dict is refused (it loads with load_state_dict or DCP).
    expect_error(parallel.state_dict(), "is a DTensor")


@pytest.mark.parametrize("world_size", [2])
def test_load_full_state_dict_errors(ranks, world_size):
    ranks(world_size).run(_check_load_errors, timeout=300)


# ---------------------------------------------------------------- clip_grad_norm_


def _local_piece(param, full):
    """This rank's piece of ``full`` in ``param``'s layout (a plain tensor)."""
    if isinstance(param, DTensor) and isinstance(param.placements[0], Shard):
        return torch_tp.shard(full, param.placements[0].dim, param.device_mesh)
    return full


def _as_grad(param, full_grad):
    """``full_grad`` in ``param``'s layout: a DTensor for a DTensor parameter."""
    if isinstance(param, DTensor):
        return distribute_tensor(full_grad.clone(), param.device_mesh, param.placements, src_data_rank=None)
    return full_grad.clone()


def _check_clip(sequence_parallel, vocab, norm_type, max_norm, exact_grads, drop_grad):
    reference, parallel = _models(sequence_parallel, vocab)
    ids = _ids(vocab)
    _loss(reference(ids)).backward()
    _loss(parallel(ids)).backward()
    pairs = list(zip(reference.named_parameters(), parallel.parameters()))
    for (name, p_ref), p_par in pairs:
        if drop_grad and name in ("norm.weight", "layers.1.feed_forward.w1.weight"):
            p_ref.grad = p_par.grad = None  # a replicated and a sharded parameter without a gradient
        elif exact_grads:
            p_par.grad = _as_grad(p_par, p_ref.grad)  # a copy: torch clips p_ref.grad in place
    before = {name: None if p.grad is None else _local(p.grad).clone() for (name, _), p in pairs}

    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    # torch's own clip_grad_norm_ on the DTensor parameters, then torch_tp's on the
    # same gradients. torch's needs every gradient to be a DTensor (the sequence-
    # parallel plan; with plain norm weights it refuses mixed Tensor and DTensor,
    # for torch's TP as for torch_tp's), and cannot take the inf-norm of a rank's
    # empty piece (an uneven vocabulary at 3 and 4 ranks); torch_tp's can.
    empty_piece = torch.tensor([int(any(_local(p).numel() == 0 for p in parallel.parameters()))])
    dist.all_reduce(empty_piece, op=dist.ReduceOp.MAX)  # the same decision on every rank
    torch_clips = all(isinstance(p, DTensor) for p in parallel.parameters()) and not (
        norm_type == float("inf") and empty_piece.item())
    if torch_clips:
        torch_total = torch.nn.utils.clip_grad_norm_(parallel.parameters(), max_norm, norm_type)
        torch_total = torch_total.full_tensor() if isinstance(torch_total, DTensor) else torch_total
        torch_clipped = {name: None if p.grad is None else _local(p.grad).clone() for (name, _), p in pairs}
        for (name, _), p in pairs:
            if p.grad is not None:
                _local(p.grad).copy_(before[name])
    total = clip_grad_norm_(parallel.parameters(), max_norm, norm_type)

    inf = norm_type == float("inf")
    rtol = 0 if inf and exact_grads else NORM_RTOL
    assert total.dtype == expected.dtype and total.shape == expected.shape
    assert_close(total, expected, f"total {norm_type}-norm", rtol=rtol, atol=0)
    if torch_clips:
        assert_close(total, torch_total, f"total {norm_type}-norm vs torch's on the DTensor parameters",
                     rtol=NORM_RTOL, atol=0)
    clipped = max_norm / (expected.item() + 1e-6) < 1
    for (name, p_ref), p_par in pairs:
        if p_ref.grad is None:
            assert p_par.grad is None, name
            continue
        grad = _local(p_par.grad)
        if torch_clips:
            assert_close(grad, torch_clipped[name], f"clipped grad {name} vs torch's clip", rtol=NORM_RTOL, atol=0)
        if not clipped:
            # The coefficient clamps to exactly 1: gradients unchanged, bit for bit.
            assert torch.equal(grad, before[name]), f"{name}: changed without clipping"
        if exact_grads:
            assert_close(grad, _local_piece(p_par, p_ref.grad), f"clipped grad {name}", rtol=rtol, atol=0)
        else:
            # Compared as the backward grads are: relative to the tensor's largest magnitude.
            assert_close(grad, _local_piece(p_par, p_ref.grad), f"clipped grad {name}", BACKWARD_RTOL,
                         floor=SCALE_FLOOR)
    return total.item(), expected.item(), clipped


CLIP_CASES = [
    # norm_type, max_norm, exact_grads, drop_grad
    (2.0, 0.05, True, False),
    (2.0, 0.05, False, False),
    (float("inf"), 0.01, True, False),
    (float("inf"), 0.01, False, False),
    (3.0, 0.05, True, True),
    (2.0, 1e6, True, False),  # no clipping
    (float("inf"), 1e6, False, True),  # no clipping
]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_clip_grad_norm_matches_unsharded(ranks, world_size, sequence_parallel):
    pool = ranks(world_size)
    for norm_type, max_norm, exact_grads, drop_grad in CLIP_CASES:
        results = pool.run(_check_clip, sequence_parallel, 31, norm_type, max_norm, exact_grads, drop_grad,
                           timeout=300)
        totals = [total for total, _, _ in results]
        assert len(set(totals)) == 1, f"ranks returned different norms: {totals}"
        _, _, clipped = results[0]
        assert clipped == (max_norm < 1), f"norm {totals[0]} vs max_norm {max_norm}: test does not clip as meant"


@pytest.mark.parametrize("world_size", [3, 4])
def test_clip_grad_norm_with_empty_shards(ranks, world_size):
    pool = ranks(world_size)
    for norm_type in (2.0, float("inf")):
        pool.run(_check_clip, True, world_size + 1, norm_type, 0.01, True, False, timeout=300)


def _check_clip_edge_cases():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded(full):
        return distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)

    # No gradients anywhere: 0, as torch.
    assert clip_grad_norm_([nn.Parameter(sharded(torch.ones(5)))], 1.0).item() == 0.0
    assert clip_grad_norm_([], 1.0).item() == 0.0
    # A single tensor.
    full_grad = torch.arange(5.0) - 2
    p = nn.Parameter(sharded(torch.zeros(5)))
    p.grad = sharded(full_grad)
    total = clip_grad_norm_(p, 10.0)
    assert torch.equal(total, torch.linalg.vector_norm(full_grad)), total
    # A non-finite norm: error on every rank (inf only on rank 0's piece), nothing scaled.
    grad = full_grad.clone()
    grad[0] = float("inf")
    p.grad = sharded(grad)
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    # NaN reaches every rank through the max all-reduce of the inf-norm.
    grad[0] = float("nan")
    p.grad = sharded(grad)
    assert clip_grad_norm_([p], 1.0, norm_type="inf").isnan(), f"rank {rank}"
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_([p], 1.0, norm_type=0)


@pytest.mark.parametrize("world_size", [1, 3])
def test_clip_grad_norm_edge_cases(ranks, world_size):
    ranks(world_size).run(_check_clip_edge_cases)
