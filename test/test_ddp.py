"""torch_tp.DistributedDataParallel against torch's DDP and an unsharded reference.

Each multi-rank check builds the same model on every rank, perturbs the
parameters of ranks other than 0 (so that the wrap-time broadcast matters),
and runs torch_tp's DDP and torch's DDP side by side on the same gloo group,
bucket size and per-rank inputs.

Gradients are compared bitwise (``torch.equal``): both reducers copy each
gradient into the same flat bucket layout with the same multiplication by
1/world_size and sum the same buffers with the same gloo all-reduce, so
every floating-point operation is the same one (NOTE [bitwise agreement with
torch DDP] in csrc/ddp/reducer.cpp). Training is compared with the
single-process model on the concatenated batch with a tolerance (RTOL below),
since there the sums are grouped differently.
"""

import contextlib
import copy
import inspect
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import torch_tp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import llama_model  # noqa: E402
from _compare import assert_close  # noqa: E402

# fp32, relative to each tensor's largest magnitude, for the data-parallel model
# against the single-process model on the whole batch. The two compute the
# same gradient as differently grouped sums (a GEMM over the whole batch
# against per-rank GEMMs plus an all-reduce of partial means), ~1e-7 apart.
# AdamW then moves a weight by about lr * g / (|g| + eps), which amplifies a
# gradient's roundoff by up to lr / eps = 10 where |g| is tiny; after five
# steps that stays well under 1e-5 of the parameters' magnitude (floored at
# PARAM_SCALE_FLOOR, since a bias that starts at 0 is only O(lr) after a step).
RTOL = 1e-5
PARAM_SCALE_FLOOR = 0.1
# Other tensors' floor, which only keeps an all-zero reference from dividing by zero.
SCALE_FLOOR = 1e-12
TINY_BUCKET_MB = 0.002  # ~2 KB: several buckets even for the small test models

# The arguments torch's DDP gained after torch 2.11, with the release that added each: torch_tp's
# DDP has them all (torch 2.15's signature), an older torch's does not.
DDP_ARGUMENTS_ADDED = {"batched_grad_copy": (2, 12), "forward_sync_buffers": (2, 13), "lazy_bucket_allocation": (2, 15)}
TORCH_DDP_HAS_FORWARD_SYNC_BUFFERS = torch.__version__ >= DDP_ARGUMENTS_ADDED["forward_sync_buffers"]


# --- models -------------------------------------------------------------------------------------


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32),
                         nn.ReLU(), nn.Linear(32, 4))


class Tied(nn.Module):
    """An embedding whose table is also the output projection (one shared parameter)."""

    def __init__(self, vocab=40, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.hidden = nn.Linear(dim, dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.weight = self.embed.weight

    def forward(self, ids):
        return self.output(self.norm(F.gelu(self.hidden(self.embed(ids)))))


class WithUnused(nn.Module):
    """`never` gets no gradient anywhere; `branch` only on even ranks (locally unused on odd ones)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.never = nn.Linear(32, 32)
        self.branch = nn.Linear(32, 32)
        self.last = nn.Linear(32, 4)

    def forward(self, x):
        h = F.relu(self.first(x))
        if dist.get_rank() % 2 == 0:
            h = h + torch.tanh(self.branch(h))
        return self.last(h)


class ConvBN(nn.Module):
    """BatchNorm buffers (running stats) that differ per rank unless broadcast."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


MODELS = {
    "mlp": (_mlp, lambda g, n: torch.randn(n, 16, generator=g)),
    "tied": (Tied, lambda g, n: torch.randint(0, 40, (n, 6), generator=g)),
    "unused": (WithUnused, lambda g, n: torch.randn(n, 16, generator=g)),
    "conv_bn": (ConvBN, lambda g, n: torch.randn(n, 3, 6, 6, generator=g)),
}


def _build(model_name):
    """The same model on every rank, then rank-dependent parameters (undone by DDP's broadcast)."""
    torch.manual_seed(0)
    model = MODELS[model_name][0]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(dist.get_rank())
        for b in model.buffers():
            if b.is_floating_point():
                b.add_(dist.get_rank())
    return model


def _rank_input(model_name, step, batch=4):
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return MODELS[model_name][1](gen, batch)


def _assert_same_grads(ours, theirs, what):
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what} {name}: grad None-ness {p.grad is None} vs torch"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), (
                f"{what} {name}: max difference {(p.grad - q.grad).abs().max().item():.3e} from torch DDP")


# --- bucket assignment ---------------------------------------------------------------------------


def test_bucket_assignment_matches_torch():
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.float64, torch.float16]
    for trial in range(30):
        n = int(torch.randint(1, 25, (1,), generator=gen))
        tensors = [torch.empty(int(torch.randint(1, 700, (1,), generator=gen)),
                               dtype=dtypes[int(torch.randint(0, 3 if trial % 2 else 1, (1,), generator=gen))])
                   for _ in range(n)]
        for limits in ([2**63 - 1], [1024], [400, 2000], [100, 1000, 5000]):
            expected = dist._compute_bucket_assignment_by_size(tensors, limits)
            assert torch_tp._C._compute_bucket_assignment_by_size(tensors, limits) == expected, (trial, limits)
            if len({t.dtype for t in tensors}) == 1:
                # With an order, torch leaves the buckets of different dtypes in
                # hash-map order; within one dtype it is the order they were closed.
                # torch takes the tensors already in that order (as its rebuild does).
                order = torch.randperm(n, generator=gen).tolist()
                expected = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], limits, [], order)
                ours = torch_tp._C._compute_bucket_assignment_by_size(tensors, limits, order)
                assert ours == expected, (trial, limits, order)


def test_bucket_assignment_errors():
    tensors = [torch.empty(3), torch.empty(4)]
    with pytest.raises(RuntimeError, match=r"order\[1\]=0 is out of range or repeated"):
        torch_tp._C._compute_bucket_assignment_by_size(tensors, [10], [0, 0])
    with pytest.raises(RuntimeError, match="order has 1 indices for 2 tensors"):
        torch_tp._C._compute_bucket_assignment_by_size(tensors, [10], [0])
    with pytest.raises(RuntimeError, match="size_limits must not be empty"):
        torch_tp._C._compute_bucket_assignment_by_size(tensors, [])


# --- gradients against torch DDP -----------------------------------------------------------------


def _check_grads_against_torch(model_name, bucket_cap_mb, find_unused, steps=3, **ddp_kwargs):
    model = _build(model_name)
    ours = torch_tp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb,
                                            find_unused_parameters=find_unused, **ddp_kwargs)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb,
                                                       find_unused_parameters=find_unused, **ddp_kwargs)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q), "parameters after the wrap-time broadcast"
    for b, c in zip(ours.buffers(), theirs.buffers()):
        assert torch.equal(b, c), "buffers after the wrap-time broadcast"
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05)
    for step in range(steps):
        x = _rank_input(model_name, step)
        for ddp in (ours, theirs):
            ddp(x).square().mean().backward()
        _assert_same_grads(ours, theirs, f"step {step}")
        for (name, b), c in zip(ours.named_buffers(), theirs.buffers()):
            assert torch.equal(b, c), f"step {step} buffer {name}"
        opt_ours.step()
        opt_theirs.step()
        opt_ours.zero_grad()
        opt_theirs.zero_grad()
    # Buckets were rebuilt in gradient order after the first backward, unless
    # find_unused_parameters (torch keeps the initial ones then).
    assert ours.reducer.has_rebuilt_buckets() == (not find_unused)
    return ours.reducer.bucket_indices()


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("bucket_cap_mb", [None, TINY_BUCKET_MB])
@pytest.mark.parametrize("model_name", ["mlp", "tied", "conv_bn"])
def test_grads_match_torch_ddp(ranks, world_size, model_name, bucket_cap_mb):
    buckets = ranks(world_size).run(_check_grads_against_torch, model_name, bucket_cap_mb, False, timeout=300)
    assert all(b == buckets[0] for b in buckets), "every rank rebuilds the same buckets"
    if bucket_cap_mb is not None and model_name == "mlp":
        assert len(buckets[0]) > 1


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("bucket_cap_mb", [None, TINY_BUCKET_MB])
def test_unused_parameters_match_torch_ddp(ranks, world_size, bucket_cap_mb):
    ranks(world_size).run(_check_grads_against_torch, "unused", bucket_cap_mb, True, timeout=300)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_as_bucket_view(ranks, world_size):
    ranks(world_size).run(_check_bucket_view, timeout=300)


def _check_bucket_view():
    buckets = _check_grads_against_torch("mlp", TINY_BUCKET_MB, False, gradient_as_bucket_view=True)
    # zero_grad(set_to_none=False) keeps .grad as the bucket views; check that
    # the gradients of one bucket share one storage and agree with torch.
    model = _build("mlp")
    ours = torch_tp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=TINY_BUCKET_MB,
                                            gradient_as_bucket_view=True)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=TINY_BUCKET_MB,
                                                       gradient_as_bucket_view=True)
    params = list(ours.parameters())
    for step in range(3):
        x = _rank_input("mlp", step)
        for ddp in (ours, theirs):
            ddp.zero_grad(set_to_none=False)
            ddp(x).square().mean().backward()
        _assert_same_grads(ours, theirs, f"step {step}")
        for bucket in ours.reducer.bucket_indices():
            storages = {params[i].grad.untyped_storage().data_ptr() for i in bucket}
            assert len(storages) == 1, f"step {step}: bucket {bucket} gradients are not views of one buffer"
    assert len({p.grad.untyped_storage().data_ptr() for p in params}) == len(buckets)


# --- training against the single-process model --------------------------------------------------


def _check_training_matches_reference(steps=5, global_batch=8):
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = _mlp()
    ddp = torch_tp.DistributedDataParallel(copy.deepcopy(reference), bucket_cap_mb=TINY_BUCKET_MB)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-4)
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-3, eps=1e-4)
    local = global_batch // world
    for step in range(steps):
        x = torch.randn(global_batch, 16, generator=torch.Generator().manual_seed(step))
        reference(x).square().mean().backward()
        # Equal local batches: the mean of the local means is the global mean.
        ddp(x[rank * local:(rank + 1) * local]).square().mean().backward()
        for (name, p), q in zip(reference.named_parameters(), ddp.module.parameters()):
            assert_close(q.grad, p.grad, f"step {step} grad {name}", RTOL, floor=SCALE_FLOOR)
        opt_ref.step()
        opt_ddp.step()
        opt_ref.zero_grad()
        opt_ddp.zero_grad()
        for (name, p), q in zip(reference.named_parameters(), ddp.module.parameters()):
            assert_close(q, p, f"step {step} param {name}", RTOL, floor=PARAM_SCALE_FLOOR)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_training_matches_single_process(ranks, world_size):
    ranks(world_size).run(_check_training_matches_reference, timeout=300)


# --- no_sync -------------------------------------------------------------------------------------


def _check_no_sync(micro_batches=3):
    world = dist.get_world_size()
    model = _build("mlp")
    ours = torch_tp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=TINY_BUCKET_MB)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=TINY_BUCKET_MB)
    reference = copy.deepcopy(ours.module)  # rank 0's weights, as broadcast
    for round_ in range(2):  # the second round runs on rebuilt buckets
        xs = [_rank_input("mlp", 10 * round_ + k) for k in range(micro_batches)]
        for ddp in (ours, theirs):
            with ddp.no_sync():
                for x in xs[:-1]:
                    ddp(x).square().mean().backward()
            ddp(xs[-1]).square().mean().backward()
        _assert_same_grads(ours, theirs, f"round {round_}")
        # Reference: the same sum of micro-batch gradients over every rank's data, divided by the ranks.
        everyone = [torch.empty(micro_batches, *xs[0].shape) for _ in range(world)]
        dist.all_gather(everyone, torch.stack(xs))
        reference.zero_grad()
        for rank_xs in everyone:
            for x in rank_xs:
                (reference(x).square().mean() / world).backward()
        for (name, p), q in zip(reference.named_parameters(), ours.module.parameters()):
            assert_close(q.grad, p.grad, f"round {round_} accumulated grad {name}", RTOL, floor=SCALE_FLOOR)
        ours.zero_grad()
        theirs.zero_grad()


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_sync_accumulates(ranks, world_size):
    ranks(world_size).run(_check_no_sync, timeout=300)


# --- buffers -------------------------------------------------------------------------------------


def _wrap(ddp_class, model, **flags):
    """``ddp_class(model, **flags)`` and the categories of the FutureWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = ddp_class(model, **flags)
    return ddp, [w.category for w in caught if issubclass(w.category, FutureWarning)]


def _check_buffer_flags(broadcast_buffers, forward_sync_buffers):
    """torch 2.13's broadcast_buffers (deprecated) and forward_sync_buffers, against torch's DDP: the
    warnings, the flags, the buffers after the wrap and after every forward (NOTE [buffer flags] in
    torch_tp/ddp.py). torch's DDP before 2.13 has only broadcast_buffers, which it does not deprecate:
    there torch_tp's warnings and flags are checked against 2.13's rules, and its buffers against
    torch's DDP given the broadcast_buffers that means the same forwards."""
    model = _build("conv_bn")
    # torch 2.13's rules: forward_sync_buffers wins; only broadcast_buffers=False (without
    # forward_sync_buffers) keeps the buffers out of the wrap; broadcast_buffers warns when given.
    forward_sync = forward_sync_buffers if forward_sync_buffers is not None else broadcast_buffers is not False
    synced_at_wrap = forward_sync_buffers is not None or broadcast_buffers is not False
    flags = dict(broadcast_buffers=broadcast_buffers, forward_sync_buffers=forward_sync_buffers)
    ours, warned = _wrap(torch_tp.DistributedDataParallel, copy.deepcopy(model), **flags)
    if TORCH_DDP_HAS_FORWARD_SYNC_BUFFERS:
        theirs, torch_warned = _wrap(torch.nn.parallel.DistributedDataParallel, copy.deepcopy(model), **flags)
        assert warned == torch_warned, f"FutureWarnings {warned} != torch's {torch_warned}"
        assert (ours.broadcast_buffers, ours.forward_sync_buffers) == (theirs.broadcast_buffers,
                                                                       theirs.forward_sync_buffers)
    else:
        assert warned == ([FutureWarning] if broadcast_buffers is not None else []), warned
        assert (ours.broadcast_buffers, ours.forward_sync_buffers) == (forward_sync, forward_sync)
        copied = copy.deepcopy(model)
        if synced_at_wrap and not forward_sync:
            # Buffers synced at the wrap only: broadcast_buffers=False skips the wrap's sync too,
            # so rank 0's buffers are broadcast here instead.
            for buffer in copied.buffers():
                dist.broadcast(buffer, 0)
        theirs = torch.nn.parallel.DistributedDataParallel(copied, broadcast_buffers=forward_sync)
    world = dist.get_world_size()

    def gathered_mean(ddp):
        out = [torch.empty_like(ddp.module.bn.running_mean) for _ in range(world)]
        dist.all_gather(out, ddp.module.bn.running_mean)
        return out

    assert all(torch.equal(m, gathered_mean(ours)[0]) for m in gathered_mean(ours)) == synced_at_wrap
    for step in range(2):
        x = _rank_input("conv_bn", step)  # rank-specific batch statistics
        for ddp in (ours, theirs):
            ddp(x).square().mean().backward()
        _assert_same_grads(ours, theirs, f"step {step}")
        for (name, b), c in zip(ours.named_buffers(), theirs.buffers()):
            assert torch.equal(b, c), f"step {step} buffer {name}"
    # An eval forward (no update of the running stats) starts from rank 0's buffers when syncing.
    diverged = gathered_mean(ours)
    assert not torch.equal(diverged[0], diverged[1])
    with torch.no_grad():
        ours.eval()(_rank_input("conv_bn", 2))
    expected = diverged[0] if ours.forward_sync_buffers else diverged[dist.get_rank()]
    assert torch.equal(ours.module.bn.running_mean, expected)


@pytest.mark.parametrize("broadcast_buffers,forward_sync_buffers",
                         [(None, None), (True, None), (False, None), (None, False), (None, True), (False, True),
                          (True, False)])
def test_buffer_flags_match_torch_ddp(ranks, broadcast_buffers, forward_sync_buffers):
    ranks(2).run(_check_buffer_flags, broadcast_buffers, forward_sync_buffers)


# --- errors --------------------------------------------------------------------------------------


def _check_unused_without_flag():
    ddp = torch_tp.DistributedDataParallel(_build("unused"))
    with pytest.raises(RuntimeError) as info:
        ddp(_rank_input("unused", 0)).sum().backward()
    message = str(info.value)
    assert "find_unused_parameters=True" in message, message
    assert "never.weight" in message and "never.bias" in message, message
    # The wrapper keeps working once the model is fixed up.
    ddp = torch_tp.DistributedDataParallel(_build("unused"), find_unused_parameters=True)
    ddp(_rank_input("unused", 0)).sum().backward()
    assert ddp.module.never.weight.grad is None and ddp.module.first.weight.grad is not None


def test_unused_parameter_without_find_unused_raises(ranks):
    ranks(2).run(_check_unused_without_flag)


def _check_shape_mismatch():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3 + dist.get_rank()))
    with pytest.raises(RuntimeError, match=r"parameter '1.weight' has shape \[3, 4\].*on rank 0.*"
                                           r"'1.weight' has shape \[4, 4\].*on rank 1|"
                                           r"parameter '1.weight' has shape \[4, 4\].*on rank 1.*"
                                           r"'1.weight' has shape \[3, 4\].*on rank 0"):
        torch_tp.DistributedDataParallel(model)


def test_parameter_shape_mismatch_raises_at_wrap_time(ranks):
    ranks(2).run(_check_shape_mismatch)


def _check_argument_errors():
    model = _mlp()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with pytest.raises(RuntimeError, match="both process_group and device_mesh"):
        torch_tp.DistributedDataParallel(model, process_group=dist.group.WORLD, device_mesh=mesh)
    with pytest.raises(ValueError, match="bucket_cap_mb=0 must be positive"):
        torch_tp.DistributedDataParallel(model, bucket_cap_mb=0)
    with pytest.warns(FutureWarning, match="`check_reduction` argument is deprecated and ignored"):
        torch_tp.DistributedDataParallel(model, check_reduction=True)
    with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a gradient"):
        torch_tp.DistributedDataParallel(nn.ReLU())
    ddp = torch_tp.DistributedDataParallel(model, device_mesh=mesh)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="can only be called once"):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(ValueError, match=r"hook must take \(state, bucket\)"):
        torch_tp.DistributedDataParallel(model).register_comm_hook(None, lambda bucket: bucket)


def test_argument_errors(ranks):
    ranks(2).run(_check_argument_errors)


# --- comm hooks ----------------------------------------------------------------------------------

_HOOK_CALLS = []


def _python_allreduce_hook(state, bucket):
    """Not one of torch's default hooks, so it runs as a Python hook."""
    _HOOK_CALLS.append((bucket.index(), bucket.is_last(), [tuple(g.shape) for g in bucket.gradients()],
                        [tuple(p.shape) for p in bucket.parameters()]))
    return default_hooks.allreduce_hook(state, bucket)


def _check_comm_hook(hook_name):
    hook = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook, "python": _python_allreduce_hook}[hook_name]
    model = _build("mlp")
    ours = torch_tp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=TINY_BUCKET_MB)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=TINY_BUCKET_MB)
    ours.register_comm_hook(dist.group.WORLD, hook)
    try:
        theirs.register_comm_hook(dist.group.WORLD, hook)
    except TypeError:
        # torch's DDP takes bf16_compress_hook only on a CUDA+NCCL build (it
        # checks the hook's name); the hook itself runs on gloo, so a CPU-only
        # torch's reference registers it under another name.
        def bf16_reference_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            return hook(state, bucket)

        theirs.register_comm_hook(dist.group.WORLD, bf16_reference_hook)
    for step in range(3):
        x = _rank_input("mlp", step)
        calls = []
        for ddp in (ours, theirs):
            _HOOK_CALLS.clear()
            ddp(x).square().mean().backward()
            calls.append(list(_HOOK_CALLS))
        _assert_same_grads(ours, theirs, f"{hook_name} step {step}")
        # A Python hook sees the same buckets as torch's GradBucket shows: index,
        # is_last, gradient and parameter shapes, in the same order.
        assert calls[0] == calls[1], f"step {step}: hook calls {calls[0]} != torch's {calls[1]}"
        if hook_name == "python":
            assert len(calls[0]) == len(ours.reducer.bucket_indices())
        for ddp in (ours, theirs):
            ddp.zero_grad()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("hook_name", ["allreduce", "fp16", "bf16", "python"])
def test_comm_hook_matches_torch_ddp(ranks, world_size, hook_name):
    ranks(world_size).run(_check_comm_hook, hook_name, timeout=300)


# --- 2-D: tensor parallel inside data parallel ---------------------------------------------------


def _check_2d(ddp_class, steps=3):
    """torch_tp's TP on mesh["tp"] inside a DDP (torch_tp's or torch's) on mesh["dp"],
    against the unsharded model on the whole batch. Both DDPs train the DTensor
    parameters' local tensors (NOTE [DTensor parameters under
    DistributedDataParallel] in torch_tp/ddp.py), so their gradients and values are
    unsharded through the DTensor parameters the TP plan made."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = llama_model.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    torch.manual_seed(0)
    reference = llama_model.Llama(config)
    reference.init_weights()
    model = copy.deepcopy(reference)
    torch_tp.parallelize_module(model, mesh["tp"], llama_model.tp_plan("torch_tp", loss_parallel=False))
    layouts = [p for p in model.parameters()]  # the DTensor parameters: mesh, placements, global shape
    assert all(isinstance(p, DTensor) for p in layouts)
    ddp = ddp_class(model, device_mesh=mesh["dp"], bucket_cap_mb=0.01)
    trained = list(ddp.parameters())  # what each DDP reduces and the optimizer updates: local tensors
    assert len(trained) == len(layouts) and not any(isinstance(p, DTensor) for p in trained)

    def full(layout, local):
        return DTensor.from_local(local, layout.device_mesh, layout.placements, run_check=False, shape=layout.shape,
                                  stride=layout.stride()).full_tensor()

    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-4)
    opt_ddp = torch.optim.AdamW(trained, lr=1e-3, eps=1e-4)
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, config.vocab_size, (4, 9), generator=gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten()).backward()
        mine = slice(2 * dp_rank, 2 * dp_rank + 2)  # this dp rank's half of the batch
        F.cross_entropy(ddp(inputs[mine]).flatten(0, 1), targets[mine].flatten()).backward()
        for (name, p), layout, q in zip(reference.named_parameters(), layouts, trained):
            assert_close(full(layout, q.grad), p.grad, f"step {step} grad {name}", RTOL, floor=SCALE_FLOOR)
        opt_ref.step()
        opt_ddp.step()
        opt_ref.zero_grad()
        opt_ddp.zero_grad()
        for (name, p), layout, q in zip(reference.named_parameters(), layouts, trained):
            assert_close(full(layout, q.detach()), p.detach(),
                         f"step {step} param {name}", RTOL, floor=PARAM_SCALE_FLOOR)
    if ddp_class is torch_tp.DistributedDataParallel:
        assert ddp.reducer.has_rebuilt_buckets() and len(ddp.reducer.bucket_indices()) > 1
    # Outside the forward, the modules hold the local parameters again.
    assert all(p is q for p, q in zip(model.parameters(), trained))


@pytest.mark.parametrize("ddp_class", [torch_tp.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel],
                         ids=["torch_tp_ddp", "torch_ddp"])
def test_2d_dp_tp_matches_unsharded(ranks, ddp_class):
    ranks(4).run(_check_2d, ddp_class, timeout=300)


# --- torch's signature ---------------------------------------------------------------------------


def test_signature_matches_torch_ddp():
    """torch 2.15's signature (README), which is the running torch's with the arguments added since."""
    ours = [(p.name, p.kind, p.default)
            for p in inspect.signature(torch_tp.DistributedDataParallel.__init__).parameters.values()]
    theirs = [(p.name, p.kind, p.default)
              for p in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters.values()]
    if not TORCH_DDP_HAS_FORWARD_SYNC_BUFFERS:
        # Before torch 2.13, broadcast_buffers defaulted to True: what torch_tp's None means when
        # forward_sync_buffers, which such a torch lacks, is not given.
        ours = [(name, kind, True if name == "broadcast_buffers" else default) for name, kind, default in ours]
    ours = [argument for argument in ours
            if argument[0] not in DDP_ARGUMENTS_ADDED or torch.__version__ >= DDP_ARGUMENTS_ADDED[argument[0]]]
    assert ours == theirs


@pytest.mark.parametrize("option,value", [
    ("delay_all_reduce_named_params", [("w", nn.Parameter(torch.zeros(1)))]),
    ("param_to_hook_all_reduce", nn.Parameter(torch.zeros(1))),
    ("skip_all_reduce_unused_params", True),
    ("bucket_cap_mb_list", [1, 25]),
    ("batched_grad_copy", True),
    ("lazy_bucket_allocation", True),
])
def test_unimplemented_options_raise(option, value):
    # Checked before anything else, so no process group is needed.
    with pytest.raises(NotImplementedError, match=rf"DistributedDataParallel: {option}=.* is not implemented"):
        torch_tp.DistributedDataParallel(_mlp(), **{option: value})


def test_manual_backward_finalization_is_off_and_refused():
    """torch 2.15's manual finalization: off, as torch's DDP is by default; turning it on is refused (not
    implemented), and finalize_backward raises as torch's does while it is off. No process group is needed:
    the module is never built past the properties, which read no state."""
    ddp = torch_tp.DistributedDataParallel.__new__(torch_tp.DistributedDataParallel)
    assert ddp.require_manual_backward_finalization is False
    assert ddp.should_finalize_after_backward is False
    with pytest.raises(NotImplementedError, match="require_manual_backward_finalization=True is not implemented"):
        ddp.require_manual_backward_finalization = True
    ddp.require_manual_backward_finalization = False
    with pytest.raises(RuntimeError, match="require_manual_backward_finalization is False"):
        ddp.finalize_backward()


def _check_device_arguments():
    """CPU module: torch's errors for device_ids/output_device, and what it keeps of them and of dim."""
    model = _mlp()
    for bad in (dict(device_ids=[0, 1]), dict(device_ids=[0]), dict(output_device=1),
                dict(device_ids=[0], output_device=0)):
        errors = []
        for ddp_class in (torch_tp.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
            with pytest.raises(ValueError) as info:
                ddp_class(model, **bad)
            errors.append(info)
        assert "DistributedDataParallel" in str(errors[0].value)
        assert all(str(v) in str(errors[0].value) for v in bad.values()), (bad, str(errors[0].value))
    # As torch: an empty device_ids and a falsy output_device pass; dim is kept; the forward neither
    # scatters the inputs along dim nor gathers the output.
    x = _rank_input("mlp", 0)
    outputs = []
    for ddp_class in (torch_tp.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        ddp = ddp_class(copy.deepcopy(model), device_ids=[], output_device=0, dim=1)
        assert (ddp.device_ids, ddp.output_device, ddp.dim, ddp.device) == (None, None, 1, torch.device("cpu"))
        outputs.append(ddp(x))
    assert torch.equal(outputs[0], outputs[1]) and outputs[0].shape == (x.shape[0], 4)


def test_device_arguments_match_torch_ddp(ranks):
    ranks(2).run(_check_device_arguments)


def _check_init_sync_off():
    """init_sync=False: no wrap-time broadcast (each rank keeps its own weights), as torch's DDP."""
    own = [p.detach().clone() for p in _build("mlp").parameters()]
    _check_grads_against_torch("mlp", TINY_BUCKET_MB, False, steps=2, init_sync=False)
    ddp = torch_tp.DistributedDataParallel(_build("mlp"), init_sync=False)
    assert all(torch.equal(p, q) for p, q in zip(ddp.parameters(), own)), "init_sync=False changed the weights"
    first = ddp.module[0].weight.detach().clone()
    everyone = [torch.empty_like(first) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, first)
    assert not torch.equal(everyone[0], everyone[1]), "_build gives each rank its own weights"


def test_init_sync_false_keeps_each_ranks_weights(ranks):
    ranks(2).run(_check_init_sync_off)


# --- mixed precision -----------------------------------------------------------------------------

# NOTE [torch's mixed precision on CPU] torch's DDP(mixed_precision=...) makes
# torch.Stream()s and torch.Event()s for its parameter casts, which raise
# without an accelerator. On the CPU every op is synchronous, so the reference
# runs with stand-ins that do nothing; the arithmetic is torch's own.


class _NoStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, stream):
        pass


class _NoEvent:
    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass


@contextlib.contextmanager
def _cpu_streams():
    if torch.accelerator.is_available():
        yield
        return
    saved = torch.Stream, torch.Event, torch.accelerator.current_stream
    torch.Stream, torch.Event, torch.accelerator.current_stream = _NoStream, _NoEvent, lambda *args: _NoStream()
    try:
        yield
    finally:
        torch.Stream, torch.Event, torch.accelerator.current_stream = saved


def _check_mixed_precision(model_name, param_dtype, reduce_dtype, buffer_dtype, steps=3):
    """Against torch's DDP with the same _MixedPrecision: gradients, parameters and buffers bitwise.
    Both cast the same parameters and inputs to param_dtype, run the same ops on them, and sum the same
    reduce_dtype buckets (same layout) then divide (NOTE [mixed precision] in torch_tp/ddp.py).

    torch 2.14's first mixed-precision backward leaves garbage in .grad on this CPU build (its buckets
    are built before it learns param_dtype, and are right once rebuilt after that backward): torch's
    DDP gets a backward of its own first, which is thrown away, and the comparison starts after it
    with the input our first backward saw, so that ours is checked on its initial buckets too."""
    from torch.nn.parallel.distributed import _MixedPrecision

    config = _MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype)
    model = _build(model_name)
    ours = torch_tp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=TINY_BUCKET_MB,
                                            mixed_precision=config)
    with _cpu_streams():
        theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=TINY_BUCKET_MB,
                                                           mixed_precision=config)
        with torch.no_grad():
            saved = [t.clone() for t in theirs.module.state_dict().values()]
        theirs(_rank_input(model_name, 0)).float().square().mean().backward()
        theirs.zero_grad()
        with torch.no_grad():  # undo the forward's running-stats update
            for t, value in zip(theirs.module.state_dict().values(), saved):
                t.copy_(value)
    with pytest.raises(RuntimeError, match="mixed_precision=.* reduces the gradients with its own hook"):
        ours.register_comm_hook(None, default_hooks.allreduce_hook)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05)
    for step in range(steps):
        x = _rank_input(model_name, step)
        with _cpu_streams():
            out_theirs = theirs(x)
            out_theirs.float().square().mean().backward()
        out_ours = ours(x)
        out_ours.float().square().mean().backward()
        assert out_ours.dtype == out_theirs.dtype == (param_dtype or torch.float32)
        for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
            assert p.dtype == q.dtype == torch.float32 and p.grad.dtype == q.grad.dtype == torch.float32, name
        _assert_same_grads(ours, theirs, f"step {step}")
        for (name, b), c in zip(ours.module.named_buffers(), theirs.module.buffers()):
            assert b.dtype == c.dtype and torch.equal(b, c), f"step {step} buffer {name}"
        opt_ours.step()
        opt_theirs.step()
        opt_ours.zero_grad()
        opt_theirs.zero_grad()
        for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
            assert torch.equal(p, q), f"step {step} param {name}"
    if param_dtype is not None:
        # Not trivially so: the float32 model's gradients differ.
        reference = copy.deepcopy(ours.module).float()
        reference(_rank_input(model_name, 0).float()).square().mean().backward()
        ours(_rank_input(model_name, 0)).float().square().mean().backward()
        assert any(not torch.equal(p.grad, q.grad) for p, q in zip(reference.parameters(), ours.parameters()))


@pytest.mark.parametrize("model_name,param_dtype,reduce_dtype,buffer_dtype", [
    ("mlp", torch.bfloat16, None, None),
    ("mlp", torch.bfloat16, torch.float32, None),
    ("mlp", torch.float16, torch.float32, None),
    ("conv_bn", torch.bfloat16, None, torch.bfloat16),
])
def test_mixed_precision_matches_torch_ddp(ranks, model_name, param_dtype, reduce_dtype, buffer_dtype):
    ranks(2).run(_check_mixed_precision, model_name, param_dtype, reduce_dtype, buffer_dtype, timeout=300)


# --- join: uneven inputs -------------------------------------------------------------------------

# Batches per rank: every rank joins at a different step, and the last to
# join is not rank 0 (whose buffers and bucket order are the defaults).
JOIN_BATCHES = {2: [2, 4], 3: [4, 2, 3]}


def _train_under_join(ddp, model_name, batches, **join_kwargs):
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with ddp.join(**join_kwargs):
        for step in range(batches):
            ddp(_rank_input(model_name, step)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()


def _check_join(model_name, divide_by_initial_world_size, find_unused):
    """join() against torch's DDP on the same uneven data: the final parameters and buffers.

    Bitwise: on a rank still training both copy the same gradients into the same buckets with the same
    multiplication by 1/divisor, the joined ranks add zeros to the same all-reduces, and the ranks that
    update the parameters and the one the final broadcast comes from are the same."""
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = JOIN_BATCHES[world][rank]
    model = _build(model_name)
    kwargs = dict(bucket_cap_mb=TINY_BUCKET_MB, find_unused_parameters=find_unused)
    ours = torch_tp.DistributedDataParallel(copy.deepcopy(model), **kwargs)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), **kwargs)
    initial = [p.detach().clone() for p in ours.parameters()]
    for ddp in (ours, theirs):
        _train_under_join(ddp, model_name, batches, divide_by_initial_world_size=divide_by_initial_world_size)
    for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
        assert torch.equal(p, q), f"{name}: max difference {(p - q).abs().max().item():.3e} from torch DDP"
    assert not all(torch.equal(p, p0) for p, p0 in zip(ours.parameters(), initial)), "nothing was trained"
    for (name, b), c in zip(ours.module.named_buffers(), theirs.module.buffers()):
        assert torch.equal(b, c), f"buffer {name}"
    # The final broadcast left every rank with the same model.
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(f, everyone[0]) for f in everyone)
    return ours.reducer.has_rebuilt_buckets()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
@pytest.mark.parametrize("model_name,find_unused", [("mlp", False), ("conv_bn", False), ("unused", True)])
def test_join_matches_torch_ddp(ranks, world_size, divide_by_initial_world_size, model_name, find_unused):
    rebuilt = ranks(world_size).run(_check_join, model_name, divide_by_initial_world_size, find_unused,
                                    timeout=300)
    assert rebuilt == [not find_unused] * world_size


def _check_join_divisor():
    """divide_by_initial_world_size=False divides by the ranks still training: rank 1 alone trains
    the last step, so its gradient there is its own, undivided."""
    model = _build("mlp")
    ddp = torch_tp.DistributedDataParallel(copy.deepcopy(model))
    reference = copy.deepcopy(ddp.module)  # rank 0's weights, as broadcast
    grads = {}
    with ddp.join(divide_by_initial_world_size=False):
        for step in range(JOIN_BATCHES[2][dist.get_rank()]):
            ddp(_rank_input("mlp", step)).square().mean().backward()
            grads[step] = [p.grad.clone() for p in ddp.parameters()]
            ddp.zero_grad()
    if dist.get_rank() == 1:
        reference(_rank_input("mlp", 3)).square().mean().backward()
        for (name, p), g in zip(reference.named_parameters(), grads[3]):
            assert torch.equal(g, p.grad), f"{name}: a rank alone divides by 1"


def test_join_divides_by_the_ranks_still_training(ranks):
    ranks(2).run(_check_join_divisor)


def _check_join_throws():
    """throw_on_early_termination=True: every rank raises as soon as one runs out, with torch's messages."""
    world, rank = dist.get_world_size(), dist.get_rank()
    messages = []
    for ddp_class in (torch_tp.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        ddp = ddp_class(_build("mlp"))
        with pytest.raises(RuntimeError) as info:
            _train_under_join(ddp, "mlp", JOIN_BATCHES[world][rank], throw_on_early_termination=True)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    return messages[0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_throw_on_early_termination(ranks, world_size):
    messages = ranks(world_size).run(_check_join_throws)
    first = JOIN_BATCHES[world_size].index(min(JOIN_BATCHES[world_size]))
    assert messages[first] == f"Rank {first} exhausted all inputs."
    assert all("Detected at least one rank that exhausted inputs" in m for r, m in enumerate(messages) if r != first)
