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

import copy
import os
import sys

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
TINY_BUCKET_MB = 0.002  # ~2 KB: several buckets even for the small test models


def _close(actual, expected, what, floor=1e-12):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().clamp_min(floor)
    error = ((actual - expected).abs().max() / scale).item()
    assert error <= RTOL, f"{what}: relative error {error:.2e} > {RTOL:.0e}"


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
            _close(q.grad, p.grad, f"step {step} grad {name}")
        opt_ref.step()
        opt_ddp.step()
        opt_ref.zero_grad()
        opt_ddp.zero_grad()
        for (name, p), q in zip(reference.named_parameters(), ddp.module.parameters()):
            _close(q, p, f"step {step} param {name}", PARAM_SCALE_FLOOR)


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
            _close(q.grad, p.grad, f"round {round_} accumulated grad {name}")
        ours.zero_grad()
        theirs.zero_grad()


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_sync_accumulates(ranks, world_size):
    ranks(world_size).run(_check_no_sync, timeout=300)


# --- buffers -------------------------------------------------------------------------------------


def _check_buffers(broadcast_buffers):
    model = _build("conv_bn")
    ddp = torch_tp.DistributedDataParallel(model, broadcast_buffers=broadcast_buffers)
    world = dist.get_world_size()

    def gathered_mean():
        out = [torch.empty_like(model.bn.running_mean) for _ in range(world)]
        dist.all_gather(out, model.bn.running_mean)
        return out

    assert all(torch.equal(m, gathered_mean()[0]) for m in gathered_mean()), "wrap-time broadcast"
    ddp(_rank_input("conv_bn", 0)).sum().backward()  # rank-specific batch statistics
    diverged = gathered_mean()
    assert not torch.equal(diverged[0], diverged[1])
    # The next forward starts from rank 0's buffers (when broadcasting): rank
    # 0's running mean then is the value every rank held before its update.
    before = model.bn.running_mean.clone()
    with torch.no_grad():
        ddp.eval()(_rank_input("conv_bn", 1))  # eval: no update of the running stats
    after = gathered_mean()
    if broadcast_buffers:
        assert all(torch.equal(m, diverged[0]) for m in after)
    else:
        assert torch.equal(model.bn.running_mean, before)


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffer_broadcast(ranks, broadcast_buffers):
    ranks(2).run(_check_buffers, broadcast_buffers)


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
    with pytest.raises(ValueError, match="device_ids only works with a module on a single GPU"):
        torch_tp.DistributedDataParallel(model, device_ids=[0])
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
            _close(full(layout, q.grad), p.grad, f"step {step} grad {name}")
        opt_ref.step()
        opt_ddp.step()
        opt_ref.zero_grad()
        opt_ddp.zero_grad()
        for (name, p), layout, q in zip(reference.named_parameters(), layouts, trained):
            _close(full(layout, q.detach()), p.detach(), f"step {step} param {name}", PARAM_SCALE_FLOOR)
    if ddp_class is torch_tp.DistributedDataParallel:
        assert ddp.reducer.has_rebuilt_buckets() and len(ddp.reducer.bucket_indices()) > 1
    # Outside the forward, the modules hold the local parameters again.
    assert all(p is q for p, q in zip(model.parameters(), trained))


@pytest.mark.parametrize("ddp_class", [torch_tp.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel],
                         ids=["torch_tp_ddp", "torch_ddp"])
def test_2d_dp_tp_matches_unsharded(ranks, ddp_class):
    ranks(4).run(_check_2d, ddp_class, timeout=300)
