"""torch_tp models in PyTorch's distributed training stack, against torch's own TP and the unsharded model.

torch_tp's parameters are the DTensors torch's parallelize_module makes (NOTE
[DTensor parameters, local forward] in torch_tp/parallel/_params.py), so what
learns the layout from a DTensor parameter works on them unchanged:
state_dict/load_state_dict, torch.distributed.checkpoint (DCP) with
resharding, its state_dict helpers, FSDP2 on a 2-D mesh, optimizers,
meta-device initialization. Each test runs the same script on torch_tp's model,
on torch's TP model and on the unsharded model.

The model is the example's Llama (examples/llama_model.py) with 6 heads, so
that TP degrees 2 and 3 both divide them, a vocabulary of 67 (uneven pieces at
2, 3 and 4 ranks) and sequences of 12 tokens (even sequence shards at 1 to 4
ranks; uneven ones have a test of their own).

Tolerance: the models run in float64, so sums taken in another order (sharded
GEMMs, reductions over ranks, FSDP2's reduce-scatter) differ by ~1e-16
relative. AdamW's first steps divide each gradient by its own magnitude plus
eps (1e-8), which amplifies a gradient's roundoff by up to lr / eps = 1e5 where
the exact gradient is ~0: ~1e-11 of a weight. F64_RTOL = 1e-9, relative to each
tensor's largest magnitude (a bug, such as a norm weight updated from its
partial gradient, moves values by 1e-3 and more). Checkpoint round trips at
the same TP degree are compared bitwise: they only move data.
"""

import copy
import io
import os
import sys
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
import torch.distributed.tensor.parallel as torch_tp_api
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import llama_model  # noqa: E402
from test_checkpoint import _local  # noqa: E402
from test_parallelize import _full_param as _full  # noqa: E402
from _compare import assert_close  # noqa: E402

F64_RTOL = 1e-9
# multiple_of=48: an FFN hidden size of 144, which 2, 3 and 4 divide (torch's TP needs an even split there).
CONFIG = dict(vocab_size=67, dim=48, n_layers=2, n_heads=6, multiple_of=48, max_seq_len=12)
BATCH, SEQ = 4, 12
LIBS = {"torch_tp": torch_tp, "torch": torch_tp_api}


def _llama(seed, device=None, **config):
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return llama_model.Llama(llama_model.LlamaConfig(**{**CONFIG, **config})).double()


def _parallelize(model, lib, mesh, sequence_parallel=True, loss_parallel=True):
    if lib is not None:
        LIBS[lib].parallelize_module(model, mesh, llama_model.tp_plan(
            LIBS[lib], loss_parallel=loss_parallel, sequence_parallel=sequence_parallel))
    return model


def _batch(step, rows=slice(None), seq=SEQ):
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, seq + 1), generator=torch.Generator().manual_seed(step))
    return tokens[rows, :-1], tokens[rows, 1:]


def _train(model, optimizer, lib, steps, loss_parallel=True, rows=slice(None), seq=SEQ) -> List[float]:
    """Train on the batches of ``steps``; the losses (this rank's rows' mean)."""
    losses = []
    for step in steps:
        inputs, targets = _batch(step, rows, seq)
        context = LIBS[lib].loss_parallel() if (lib and loss_parallel) else torch.enable_grad()
        with context:
            loss = llama_model.cross_entropy_loss(model(inputs), targets)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_full(loss).item())
    return losses


def _adamw(model, **kwargs):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)


def _reference(steps, seed=0):
    """The unsharded model after training on ``steps``, and its losses."""
    model = _llama(seed)
    losses = _train(model, _adamw(model), None, steps)
    return model, losses


def _assert_model_equals_reference(model, reference, what):
    params = dict(model.named_parameters())
    for name, expected in reference.named_parameters():
        assert_close(params[name], expected, f"{what}: {name}", F64_RTOL)


# ---------------------------------------------------------------- state dicts


def _check_state_dict_interchange():
    """model.state_dict() holds DTensors with torch's placements and global shapes, and a
    torch_tp model and a torch TP model load each other's state dicts exactly."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = {lib: _parallelize(_llama(0), lib, mesh) for lib in LIBS}
    states = {lib: m.state_dict() for lib, m in models.items()}
    assert list(states["torch_tp"]) == list(states["torch"])
    for key, theirs in states["torch"].items():
        ours = states["torch_tp"][key]
        assert isinstance(ours, DTensor) and isinstance(theirs, DTensor), key
        assert (ours.placements, ours.shape, ours.device_mesh) == (theirs.placements, theirs.shape,
                                                                  theirs.device_mesh), key
    # One step of torch's model moves its weights; torch_tp's model takes them, bitwise, and back.
    _train(models["torch"], _adamw(models["torch"]), "torch", [0])
    models["torch_tp"].load_state_dict(models["torch"].state_dict())
    for (name, ours), theirs in zip(models["torch_tp"].named_parameters(), models["torch"].parameters()):
        assert torch.equal(ours.to_local(), theirs.to_local()), name
    reference, _ = _reference([0])
    _assert_model_equals_reference(models["torch_tp"], reference, "loaded from torch's TP")
    fresh = _parallelize(_llama(1), "torch", mesh)
    fresh.load_state_dict(models["torch_tp"].state_dict())
    for (name, ours), theirs in zip(models["torch_tp"].named_parameters(), fresh.parameters()):
        assert torch.equal(ours.to_local(), theirs.to_local()), name


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_dict_interchange_with_torch(ranks, world_size):
    ranks(world_size).run(_check_state_dict_interchange, timeout=300)


def _check_full_state_dicts():
    """torch's get_state_dict(full_state_dict=True) gathers model and optimizer state into the
    unsharded model's (torch_tp.get_full_state_dict gives the same model part, bitwise)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _parallelize(_llama(0), "torch_tp", mesh)
    optimizer = _adamw(model)
    _train(model, optimizer, "torch_tp", range(2))
    reference = _llama(0)
    reference_opt = _adamw(reference)
    _train(reference, reference_opt, None, range(2))
    options = StateDictOptions(full_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    want_model, want_optim = get_state_dict(reference, reference_opt, options=options)
    assert list(model_state) == list(want_model)
    ours = torch_tp.get_full_state_dict(model)
    for key, want in want_model.items():
        assert not isinstance(model_state[key], DTensor), key
        assert_close(model_state[key], want, f"model state {key}", F64_RTOL)
        assert torch.equal(ours[key], model_state[key]), f"torch_tp.get_full_state_dict {key}"
    assert optim_state["param_groups"] == want_optim["param_groups"]
    assert set(optim_state["state"]) == set(want_optim["state"])
    for fqn, state in want_optim["state"].items():
        for key, want in state.items():
            got = optim_state["state"][fqn][key]
            assert not isinstance(got, DTensor) and got.shape == want.shape, (fqn, key)
            assert_close(got, want, f"optimizer state {fqn}.{key}", F64_RTOL)


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_model_and_optimizer_state_dicts(ranks, world_size):
    ranks(world_size).run(_check_full_state_dicts, timeout=300)


# ---------------------------------------------------------------- DCP


def _dcp_save(path, steps):
    """torch_tp at this world size trains on ``steps`` and saves model and optimizer with DCP."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _parallelize(_llama(0), "torch_tp", mesh)
    optimizer = _adamw(model)
    losses = _train(model, optimizer, "torch_tp", steps)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return losses


def _dcp_resume(path, lib, done, more):
    """A model of other weights, parallelized by ``lib`` (None: unsharded) at this world size,
    loads the checkpoint of ``done`` steps and trains ``more``; its losses and parameters must
    be the unsharded model's trained on all of them."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _parallelize(_llama(1), lib, mesh)
    optimizer = _adamw(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    losses = _train(model, optimizer, lib, more)
    reference, expected = _reference(list(done) + list(more))
    for step, got, want in zip(more, losses, expected[len(done):]):
        assert abs(got - want) <= F64_RTOL * abs(want), f"{lib} step {step}: loss {got!r} vs unsharded {want!r}"
    _assert_model_equals_reference(model, reference, f"{lib} after resuming")
    return losses


def test_dcp_reshards_across_tp_degrees(ranks, tmp_path):
    """Saved by torch_tp at TP=2, loaded at TP=3 into torch_tp and into torch's TP, and into
    the unsharded model: training continues to the unsharded model's numbers."""
    path = str(tmp_path / "tp2")
    ranks(2).run(_dcp_save, path, range(2), timeout=300)
    for lib in ("torch_tp", "torch", None):
        ranks(3).run(_dcp_resume, path, lib, range(2), range(2, 4), timeout=300)
    ranks(1).run(_dcp_resume, path, None, range(2), range(2, 4), timeout=300)


def _check_resume_bitwise(path):
    """Save after 2 steps, load into a fresh model and optimizer at the same TP degree, train 2
    more: bit for bit the run that never stopped."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    straight = _parallelize(_llama(0), "torch_tp", mesh)
    straight_opt = _adamw(straight)
    expected = _train(straight, straight_opt, "torch_tp", range(4))

    _dcp_save(path, range(2))
    resumed = _parallelize(_llama(1), "torch_tp", mesh)
    optimizer = _adamw(resumed)
    model_state, optim_state = get_state_dict(resumed, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(resumed, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    losses = _train(resumed, optimizer, "torch_tp", range(2, 4))
    assert losses == expected[2:], f"{losses} vs {expected[2:]}"
    for (name, a), b in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(_local(optimizer.state[a][key]), _local(straight_opt.state[b][key])), (name, key)


@pytest.mark.parametrize("world_size", [2])
def test_dcp_resume_same_degree_is_bitwise(ranks, world_size, tmp_path):
    ranks(world_size).run(_check_resume_bitwise, str(tmp_path / "ckpt"), timeout=300)


# ---------------------------------------------------------------- FSDP2 x TP


def _check_fsdp_tp(lib, sequence_parallel, loss_parallel, steps=3):
    """torchtitan's 2-D recipe on 4 ranks: the TP plan on mesh["tp"], fully_shard on each block
    and the root over mesh["dp"], each dp rank on half the batch; the global loss after each
    step and the full state dict after the last equal the unsharded model's."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _parallelize(_llama(0), lib, mesh["tp"], sequence_parallel, loss_parallel)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = _adamw(model)
    dp_rank = mesh["dp"].get_local_rank()
    rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    reference, expected = _reference(range(steps))
    for step in range(steps):
        loss = torch.tensor(_train(model, optimizer, lib, [step], loss_parallel, rows), dtype=torch.float64)
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the dp halves' means -> the batch mean
        got = loss.item() / 2
        assert abs(got - expected[step]) <= F64_RTOL * abs(expected[step]), \
            f"{lib} step {step}: loss {got!r} vs unsharded {expected[step]!r}"
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for name, want in reference.state_dict().items():
        assert not isinstance(full[name], DTensor) and full[name].shape == want.shape, name
        assert_close(full[name], want, f"{lib} full state dict {name}", F64_RTOL)


@pytest.mark.parametrize("lib", ["torch_tp", "torch"])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp_loss_parallel", "tp"])
def test_fsdp2_tp_2d_matches_unsharded(ranks, lib, sequence_parallel):
    ranks(4).run(_check_fsdp_tp, lib, sequence_parallel, sequence_parallel, timeout=600)


# ---------------------------------------------------------------- optimizers


OPTIMIZERS = {
    "adamw_for_loop": lambda m: _adamw(m, foreach=False),
    "adamw_foreach": lambda m: _adamw(m, foreach=True),
    "adamw_fused": lambda m: _adamw(m, fused=True),
    "sgd_momentum_foreach": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=True),
}


def _check_optimizers():
    """torch's optimizers on torch_tp's DTensor parameters: the same steps as on torch's TP and
    on the unsharded model (F64_RTOL), for each implementation of the update."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name, make in OPTIMIZERS.items():
        models = {"reference": _llama(0), **{lib: _parallelize(_llama(0), lib, mesh) for lib in LIBS}}
        for lib, model in models.items():
            _train(model, make(model), None if lib == "reference" else lib, range(3))
        for lib in LIBS:
            _assert_model_equals_reference(models[lib], models["reference"], f"{name}, {lib}")


@pytest.mark.parametrize("world_size", [2])
def test_torch_optimizers_on_dtensor_parameters(ranks, world_size):
    ranks(world_size).run(_check_optimizers, timeout=600)


# ---------------------------------------------------------------- mixed precision


def _check_autocast(device_type, dtype, libs=tuple(LIBS), steps=3):
    """float32 parameters under torch.autocast, the standard AMP recipe: torch_tp's linear ops
    run in ``dtype`` as aten::linear does (NOTE [sharded linear under autocast]), the parameters
    and their gradients stay float32, and the losses track the unsharded model's under the same
    autocast, as torch's TP's do, within AMP_RTOL. float16 goes with a GradScaler (its recipe).
    ``libs``: the TP implementations run beside the unsharded model."""
    device = torch.device(device_type, dist.get_rank() % torch.cuda.device_count()) if device_type == "cuda" \
        else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    models = {"reference": _llama(0).float().to(device),
              **{lib: _parallelize(_llama(0).float().to(device), lib, mesh) for lib in libs}}
    optimizers = {name: _adamw(m) for name, m in models.items()}
    scalers = {name: torch.amp.GradScaler(device_type, enabled=dtype == torch.float16) for name in models}
    losses = {name: [] for name in models}
    for step in range(steps):
        inputs, targets = (t.to(device) for t in _batch(step))
        for name, model in models.items():
            context = torch.enable_grad() if name == "reference" else LIBS[name].loss_parallel()
            with context:
                with torch.autocast(device_type, dtype=dtype):
                    logits = model(inputs)
                    loss = llama_model.cross_entropy_loss(logits, targets)
                scalers[name].scale(loss).backward()
            assert logits.dtype == torch.float32, f"{name}: logits {logits.dtype}"
            for pname, p in model.named_parameters():
                assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, (name, pname, p.grad.dtype)
            scalers[name].step(optimizers[name])
            scalers[name].update()
            optimizers[name].zero_grad()
            losses[name].append(_full(loss).item())
    for lib in libs:
        for step, (got, want) in enumerate(zip(losses[lib], losses["reference"])):
            assert abs(got - want) <= AMP_RTOL * abs(want), f"{lib} {dtype} step {step}: {got} vs unsharded {want}"


# The losses of a mean over 48 tokens, each computed with bfloat16 (unit
# roundoff 3.9e-3) or float16 (4.9e-4) GEMMs whose sums run in other orders
# in the sharded models; the rounding largely averages out: measured within
# 4e-5 of the unsharded model's at 2 and 3 ranks (bfloat16, CPU), for torch_tp
# and torch's TP alike. 5e-4 is 12 times that; a linear layer left in float32,
# or a norm weight stepped on its partial gradient, moves the loss by 1e-3 or more.
AMP_RTOL = 5e-4
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_autocast_tracks_unsharded(ranks, world_size):
    ranks(world_size).run(_check_autocast, "cpu", torch.bfloat16, timeout=300)


@needs_cuda
@pytest.mark.parametrize("world_size", [2])
def test_fp16_autocast_with_grad_scaler_cuda(ranks, world_size):
    # gloo moves CUDA tensors, so two ranks may share one GPU. torch_tp against the unsharded
    # model only: torch's TP segfaults here (torch 2.11.0: gloo::allgather copies from the
    # device pointer of the all-gather that DTensor's redistribute runs), and
    # the CPU test above already runs torch's TP beside it.
    ranks(world_size, "gloo").run(_check_autocast, "cuda", torch.float16, ("torch_tp",), timeout=300)


# ---------------------------------------------------------------- torch.compile


def _check_compiled(steps=2):
    """torchtitan compiles each transformer block with ``fullgraph=True``: on the Llama plan (SP,
    loss_parallel) every block traces whole, forward and backward, and the compiled model trains
    as the eager one does (loss and every gradient at each step within F64_RTOL: inductor fuses
    the elementwise work, so sums round in another order). The blocks share one compiled graph
    (recompile_limit=1: a per-module guard, such as an always-called hook's id, would recompile
    for every block and a deep model would hit torch's limit of 8). The whole model compiled
    without fullgraph must do the same, with no graph break either."""
    import torch._dynamo

    # The ranks are a shared pool: an earlier test may have compiled these code objects for other
    # shapes (test_kv_heads, test_example_blocks_compile_with_dynamic_shapes), and the limit counts those.
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        _run_compiled(steps)


def _run_compiled(steps):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = {name: _parallelize(_llama(0, n_layers=3), "torch_tp", mesh) for name in ("eager", "blocks", "model")}
    for block in models["blocks"].layers.values():
        block.compile(fullgraph=True)  # in place: the parameter names stay the eager model's
    models["model"].compile()
    optimizers = {name: _adamw(m) for name, m in models.items()}
    torch._dynamo.utils.counters.clear()
    for step in range(steps):
        inputs, targets = _batch(step)
        losses, grads = {}, {}
        for name, model in models.items():
            with torch_tp.loss_parallel():
                loss = llama_model.cross_entropy_loss(model(inputs), targets)
                loss.backward()
            losses[name] = loss
            grads[name] = {pname: p.grad for pname, p in model.named_parameters()}
        for name in ("blocks", "model"):
            assert_close(losses[name], losses["eager"], f"compiled {name}: loss at step {step}", F64_RTOL)
            assert grads[name].keys() == grads["eager"].keys()
            for pname, grad in grads[name].items():
                assert grad.placements == grads["eager"][pname].placements, (name, pname, grad.placements)
                assert_close(grad, grads["eager"][pname], f"compiled {name}: {pname}.grad at step {step}", F64_RTOL)
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    reference = _llama(0, n_layers=3)
    _train(reference, _adamw(reference), None, range(steps))
    _assert_model_equals_reference(models["blocks"], reference, "compiled blocks")


@pytest.mark.parametrize("world_size", [2])
def test_compiled_blocks_and_model_match_eager(ranks, world_size):
    ranks(world_size).run(_check_compiled, timeout=600)


def _check_dynamic_shapes():
    """The example's blocks compiled with dynamic shapes (what dynamo falls back to when one code
    object meets a second shape: a TP model's local heads, then the unsharded model's): training
    steps at two sequence lengths and KV-cache decoding give eager's numbers within F64_RTOL.
    (The attention once passed SDPA a SymBool is_causal there, which it refuses.)"""
    eager, compiled = _llama(0), _llama(0)
    for block in compiled.layers.values():
        block.compile(fullgraph=True, dynamic=True)
    for seq in (SEQ, SEQ // 2):
        inputs, _ = _batch(0, seq=seq)
        assert_close(compiled(inputs), eager(inputs), f"dynamic shapes, seq {seq}: logits", F64_RTOL)
    with torch.no_grad():
        caches = {name: llama_model.KVCache(CONFIG["max_seq_len"]) for name in ("eager", "compiled")}
        prompt, _ = _batch(1)
        for tokens in (prompt[:, :5], prompt[:, 5:6], prompt[:, 6:7]):
            got, want = compiled(tokens, caches["compiled"]), eager(tokens, caches["eager"])
            assert_close(got, want, f"dynamic shapes, decoding at {caches['eager'].pos}", F64_RTOL)


def test_example_blocks_compile_with_dynamic_shapes(ranks):
    ranks(1).run(_check_dynamic_shapes, timeout=300)


class _DTensorColwise(torch_tp_api.ColwiseParallel):
    """torch's style, applied as it is (a subclass: NOTE in api.py's _from_torch): its module runs on
    DTensors, the way a LoRA or float8 linear's style would."""


def _check_compiled_dtensor_consumer():
    """Every block compiled, and ``wq`` under a DTensor style, so that it consumes the gathered
    replicated input through DTensor ops: that input's gradient comes back through rank-dependent
    code (NOTE [replicated DTensor inputs without DTensor] in _layout.py). Each rank's compiled
    backward must still issue its collectives in one order: once they differed (rank 0 an
    all-reduce, rank 1 a reduce-scatter) and the ranks waited on each other forever. The loss and
    gradients must be eager torch_tp's within F64_RTOL."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = llama_model.tp_plan(torch_tp)
    plan["layers.*.attention.wq"] = _DTensorColwise()
    models = {name: torch_tp.parallelize_module(_llama(0), mesh, plan) for name in ("eager", "blocks")}
    for block in models["blocks"].layers.values():
        block.compile(fullgraph=True)
    inputs, targets = _batch(0)
    losses = {}
    for name, model in models.items():
        with torch_tp.loss_parallel():
            losses[name] = llama_model.cross_entropy_loss(model(inputs), targets)
            losses[name].backward()
    assert_close(losses["blocks"], losses["eager"], "compiled blocks with a DTensor wq: loss", F64_RTOL)
    for (pname, param), eager in zip(models["blocks"].named_parameters(), models["eager"].parameters()):
        assert_close(param.grad, eager.grad, f"compiled blocks with a DTensor wq: {pname}.grad", F64_RTOL)


def test_compiled_blocks_with_a_dtensor_consumer(ranks):
    ranks(2).run(_check_compiled_dtensor_consumer, timeout=300)


# ---------------------------------------------------------------- uneven sequence shards


def _check_uneven_sequence(seq, steps=3):
    """Sequence parallelism with a sequence length the TP degree does not divide (16 tokens at
    3 ranks: 6, 6, 4; 4 tokens: 2, 2, 0). The shards are torch.chunk pieces end to end, although
    they pass between the layers as plain tensors (NOTE [global sizes of plain shards] in
    _layout.py): the embedding's output, every norm's DTensor output (global length ``seq``),
    and training (SP, loss_parallel; eager and with compiled blocks) equals the unsharded model's
    within F64_RTOL. torch's own TP cannot run this plan: its gathers assume even pieces.
    Compiled blocks with an empty piece are refused on every rank before any communication:
    that rank's graph may order its collectives differently."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    expected = torch_tp.ops.chunk_range(seq, dist.get_world_size(), dist.get_rank())[1]
    has_empty_piece = torch_tp.ops.chunk_range(seq, dist.get_world_size(), dist.get_world_size() - 1)[1] == 0
    reference = _llama(0, max_seq_len=seq)
    _train(reference, _adamw(reference), None, range(steps), seq=seq)
    for compiled in (False, True):
        model = _parallelize(_llama(0, max_seq_len=seq), "torch_tp", mesh)
        if compiled:
            for block in model.layers.values():
                block.compile(fullgraph=True)
            if has_empty_piece:
                with pytest.raises(Exception, match=f"a size of {seq} along dim 1 .* leaves rank"):
                    _train(model, _adamw(model), "torch_tp", range(1), seq=seq)
                continue
        seen = []
        model.tok_embeddings.register_forward_hook(lambda _m, _i, out: seen.append(("embedding", out.shape[1])))
        model.layers["0"].attention_norm.register_forward_hook(
            lambda _m, _i, out: seen.append(("norm local", out.to_local().shape[1], "global", out.shape[1])))
        _train(model, _adamw(model), "torch_tp", range(steps), seq=seq)
        if not compiled:  # compiled blocks do not run the norm's Python hooks
            assert seen[:2] == [("embedding", expected), ("norm local", expected, "global", seq)], seen[:2]
        _assert_model_equals_reference(model, reference, f"seq {seq}, {'compiled blocks' if compiled else 'eager'}")


@pytest.mark.parametrize("seq", [16, 4])
def test_uneven_sequence_shards_match_unsharded(ranks, seq):
    ranks(3).run(_check_uneven_sequence, seq, timeout=600)


def _check_records_across_calls_and_recompute(blocks_first):
    """torchtitan parallelizes the model (embedding, final norm, output) and then each block
    in calls of their own, and wraps the blocks for activation checkpointing. Each forward of
    the model starts without global-size records (NOTE [global sizes of plain shards] in
    _layout.py), the blocks' do not (they sit inside the model, in either call order), so the
    recompute in backward finds the forward's records: no plain shard's sizes are exchanged,
    and training at 16 tokens over 3 ranks (6, 6, 4) equals the unsharded model's within
    F64_RTOL."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    mesh, seq, steps = init_device_mesh("cpu", (dist.get_world_size(),)), 16, 2
    reference = _llama(0, max_seq_len=seq)
    _train(reference, _adamw(reference), None, range(steps), seq=seq)
    model = _llama(0, max_seq_len=seq)
    plan = llama_model.tp_plan(torch_tp)
    block_plan = {key.split(".", 2)[2]: style for key, style in plan.items() if key.startswith("layers.")}
    calls = [(model, {key: style for key, style in plan.items() if not key.startswith("layers.")})]
    calls += [(block, block_plan) for block in model.layers.values()]
    for module, module_plan in (calls[::-1] if blocks_first else calls):
        torch_tp.parallelize_module(module, mesh, module_plan)
    for name in list(model.layers):
        model.layers[name] = checkpoint_wrapper(model.layers[name])

    exchanges, exchange = [], torch_tp.parallel._layout._exchanged_global_size
    torch_tp.parallel._layout._exchanged_global_size = lambda *args: exchanges.append(args) or exchange(*args)
    try:
        _train(model, _adamw(model), "torch_tp", range(steps), seq=seq)
    finally:
        torch_tp.parallel._layout._exchanged_global_size = exchange
    assert not exchanges, f"{len(exchanges)} size exchange(s) in a torch_tp model"
    for name in list(model.layers):
        model.layers[name] = model.layers[name]._checkpoint_wrapped_module
    _assert_model_equals_reference(model, reference, f"{'blocks' if blocks_first else 'model'} parallelized first")


@pytest.mark.parametrize("blocks_first", [False, True])
def test_records_span_calls_and_recompute(ranks, blocks_first):
    ranks(3).run(_check_records_across_calls_and_recompute, blocks_first, timeout=600)


class _NormMLP(nn.Module):
    """A pre-norm residual MLP: a sequence-parallel norm, then column- and row-parallel linears."""

    def __init__(self, dim=8, hidden=12):
        super().__init__()
        self.norm, self.up, self.down = nn.RMSNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _norm_mlp_on_fresh_group():
    """A _NormMLP with the plain-Shard(1)-in, plain-Shard(1)-out sequence-parallel plan, on a
    group of its own: no global size was recorded under its name (NOTE [global sizes of plain
    shards] in _layout.py), so the first plain input's sizes must be exchanged."""
    torch.manual_seed(3)
    reference = _NormMLP().double()
    mesh = DeviceMesh.from_group(dist.new_group(list(range(dist.get_world_size()))), "cpu")
    model = torch_tp.parallelize_module(copy.deepcopy(reference), mesh, {
        "norm": torch_tp.SequenceParallel(),
        "up": torch_tp.ColwiseParallel(input_layouts=Shard(1)),
        "down": torch_tp.RowwiseParallel(output_layouts=Shard(1)),
    })
    return reference, model


def _check_plain_uneven_input():
    """A user's own plain Shard(1) pieces of a sequence of 16 at 3 ranks (6, 6, 4), which no
    torch_tp output made: output and input gradient are the unsharded module's pieces, within
    F64_RTOL, where torch's TP assumes even pieces; so is the next step's output at another
    length. Pieces that are not torch.chunk's split are an error on every rank, before any
    data moves."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, model = _norm_mlp_on_fresh_group()
    x = torch.randn(2, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    reference(x).square().sum().backward()
    piece = x.detach().chunk(world, dim=1)[rank].clone().requires_grad_()
    out = model(piece)
    out.square().sum().backward()
    assert_close(out, reference(x).chunk(world, dim=1)[rank], "output piece", F64_RTOL)
    assert_close(piece.grad, x.grad.chunk(world, dim=1)[rank], "input gradient piece", F64_RTOL)
    assert_close(model.up.weight.grad.full_tensor(), reference.up.weight.grad, "up.weight gradient", F64_RTOL)

    # The next step's sequence is 18 (6, 6, 6): ranks 0 and 1's pieces would fit the 16
    # recorded in the step before, rank 2's would not; the new forward starts without it.
    x = torch.randn(2, 18, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    piece = x.chunk(world, dim=1)[rank]
    assert_close(model(piece), reference(x).chunk(world, dim=1)[rank], "output piece, next step", F64_RTOL)

    _, fresh = _norm_mlp_on_fresh_group()
    not_chunk = [5, 5, 6]  # 16 rows, but torch.chunk gives 6, 6, 4
    with pytest.raises(ValueError, match=r"pieces of \[5, 5, 6\] .* not torch.chunk's split of their sum 16"):
        fresh(torch.randn(2, not_chunk[rank], 8, dtype=torch.float64))


def test_plain_uneven_shard_inputs_are_exchanged_or_refused(ranks):
    ranks(3).run(_check_plain_uneven_input, timeout=300)


# ---------------------------------------------------------------- meta-device initialization


class _PlainAllocations(TorchDispatchMode):
    """The shapes of the plain tensors ops produce. A DTensor op's output is a DTensor
    holding only this rank's piece; a full parameter would show up as a plain tensor."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                self.shapes.add(tuple(t.shape))
        return out


def _check_meta_init():
    """Build under the meta device, parallelize, to_empty(device="cpu"), init_weights: no
    sharded parameter's full shape is ever allocated, and the values and a training step are
    torch's TP's under the same recipe (DTensor's own random ops fill both)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = {}
    for lib in LIBS:
        model = _parallelize(_llama(0, device="meta"), lib, mesh)
        assert all(p.is_meta for p in model.parameters())
        with _PlainAllocations() as allocations:
            model.to_empty(device="cpu")
            torch.manual_seed(5)
            model.init_weights()
        full_shapes = {tuple(p.shape) for p in model.parameters()
                       if isinstance(p, DTensor) and p.to_local().shape != p.shape}
        assert not full_shapes & allocations.shapes, f"{lib}: allocated {full_shapes & allocations.shapes}"
        models[lib] = model
    for (name, ours), theirs in zip(models["torch_tp"].named_parameters(), models["torch"].parameters()):
        assert ours.device.type == "cpu" and torch.equal(ours.to_local(), theirs.to_local()), name
    losses = {lib: _train(m, _adamw(m), lib, range(2)) for lib, m in models.items()}
    for a, b in zip(losses["torch_tp"], losses["torch"]):
        assert abs(a - b) <= F64_RTOL * abs(b), losses


@pytest.mark.parametrize("world_size", [2, 3])
def test_meta_device_initialization(ranks, world_size):
    ranks(world_size).run(_check_meta_init, timeout=300)


# ---------------------------------------------------------------- modules torch_tp does not own


class _ScaledLinear(nn.Linear):
    """Its own forward: torch_tp must run it, not replace it."""

    def forward(self, x):
        return super().forward(x) * 0.5


class _TaggedLinear(nn.Linear):
    """A subclass that keeps nn.Linear's forward: torch_tp's fast path, its class kept as a base."""


class _TwoLayers(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.up, self.down = kind(16, 24), kind(24, 16)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


def _check_subclasses():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(2, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for kind in (_ScaledLinear, _TaggedLinear):
        results = {}
        for lib, api in LIBS.items():
            torch.manual_seed(1)
            model = api.parallelize_module(_TwoLayers(kind).double(), mesh,
                                           {"up": api.ColwiseParallel(), "down": api.RowwiseParallel()})
            out = model(x)
            out.square().sum().backward()
            results[lib] = (out, {n: p.grad for n, p in model.named_parameters()}, model)
        model = results["torch_tp"][2]
        assert isinstance(model.up, kind) and isinstance(model.up.weight, DTensor)
        if kind is _ScaledLinear:
            assert type(model.up) is kind, "a module with its own forward keeps its class"
        else:
            assert type(model.up).__name__ == "ColwiseParallel_TaggedLinear", type(model.up).__name__
            # torch.save(model) pickles the made class by its base class and style.
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
            assert type(loaded.up) is type(model.up) and type(loaded.down) is type(model.down)
            assert_close(loaded(x), results["torch_tp"][0], "output of the unpickled model", F64_RTOL)
        assert_close(results["torch_tp"][0], results["torch"][0], f"{kind.__name__} output", F64_RTOL)
        for name, grad in results["torch"][1].items():
            assert_close(results["torch_tp"][1][name], grad, f"{kind.__name__} grad {name}", F64_RTOL)


@pytest.mark.parametrize("world_size", [2])
def test_linear_subclasses(ranks, world_size):
    ranks(world_size).run(_check_subclasses)


class _HalvingRowwise(torch_tp_api.RowwiseParallel):
    """A subclass of torch's style that changes what the module computes (as torchao's
    Float8ColwiseParallel does): torch_tp must apply it as it is, not as the plain style."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return 0.5 * torch_tp_api.RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs,
                                                                     device_mesh)


class _ReplicatedParameters(torch_tp_api.ParallelStyle):
    """A style of its own (torchtitan's NoParallel): parameters replicated, DTensor in, local out."""

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import Replicate, distribute_module

        def to_dtensor(mod, inputs, mesh):
            return DTensor.from_local(inputs[0], mesh, (Replicate(),), run_check=False)

        return distribute_module(module, device_mesh, None, to_dtensor, lambda mod, out, mesh: out.to_local())


class _ThreeLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(16, 24), nn.Linear(24, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.head(self.down(F.relu(self.up(x))))


def _check_foreign_styles():
    """Styles torch_tp does not know run through their own _apply, in a plan with torch_tp's
    styles: the same outputs, gradients and parameters as torch's parallelize_module."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(2, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    results = {}
    for lib, api in LIBS.items():
        torch.manual_seed(1)
        model = api.parallelize_module(_ThreeLayers().double(), mesh, {
            "up": api.ColwiseParallel(), "down": _HalvingRowwise(), "head": _ReplicatedParameters()})
        out = model(x)
        out.square().sum().backward()
        results[lib] = (out, model)
    ours, theirs = results["torch_tp"][1], results["torch"][1]
    assert type(ours.up).__name__ == "ColwiseParallelLinear" and type(ours.down) is nn.Linear
    assert_close(results["torch_tp"][0], results["torch"][0], "output", F64_RTOL)
    for (name, p_ours), p_theirs in zip(ours.named_parameters(), theirs.parameters()):
        assert type(p_ours) is type(p_theirs) and p_ours.placements == p_theirs.placements, name
        assert_close(p_ours.grad, p_theirs.grad, f"grad {name}", F64_RTOL)


@pytest.mark.parametrize("world_size", [2])
def test_foreign_styles_apply_themselves(ranks, world_size):
    ranks(world_size).run(_check_foreign_styles)


# ---------------------------------------------------------------- bad input


def _unchanged(model, snapshot: Dict[str, torch.Tensor], what):
    for name, p in model.named_parameters():
        assert torch.equal(_local(p), snapshot[name]), f"{what}: {name} was written"


def _check_bad_input(path):
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh2d["tp"]

    # A parameter that is already a DTensor on another mesh.
    model = torch_tp_api.parallelize_module(_TwoLayers(nn.Linear), mesh2d["dp"], {"up": torch_tp_api.ColwiseParallel()})
    with pytest.raises(ValueError, match=r"parameter 'up.weight' is already a DTensor on DeviceMesh") as caught:
        torch_tp.parallelize_module(model, tp, {"up": torch_tp.ColwiseParallel()})
    assert str(mesh2d["dp"]) in str(caught.value) and str(tp) in str(caught.value)

    # Sharded twice: by torch's style, then by torch_tp's in another placement.
    model = torch_tp_api.parallelize_module(_TwoLayers(nn.Linear), tp, {"up": torch_tp_api.ColwiseParallel()})
    with pytest.raises(ValueError, match=r"'up.weight' .* is already Shard\(dim=0\) .* a second time, as "
                                         r"Shard\(dim=1\)"):
        torch_tp.parallelize_module(model, tp, {"up": torch_tp.RowwiseParallel()})
    # Refused before anything changed: the module is as torch's style left it.
    assert type(model.up) is nn.Linear and not hasattr(model.up, "_tp_state")
    assert model.up.weight.placements == (Shard(0),) and model.up.bias.placements == (Shard(0),)
    # A plan that gives one module two styles.
    with pytest.raises(ValueError, match=r"'up' \(ColwiseParallelLinear\) was already parallelized by "
                                         r"ColwiseParallel"):
        torch_tp.parallelize_module(_TwoLayers(nn.Linear), tp, {"up": torch_tp.ColwiseParallel(),
                                                                "u*": torch_tp.RowwiseParallel()})

    # Loading other global shapes: every mismatch named with both shapes and meshes, nothing written.
    small = _parallelize(_llama(0), "torch_tp", tp)
    other = copy.deepcopy(CONFIG)
    other["vocab_size"] += 1
    torch.manual_seed(0)
    big = torch_tp.parallelize_module(llama_model.Llama(llama_model.LlamaConfig(**other)).double(), tp,
                                      llama_model.tp_plan("torch_tp"))
    snapshot = {n: _local(p).clone() for n, p in big.named_parameters()}
    with pytest.raises(RuntimeError, match="nothing was loaded") as caught:
        big.load_state_dict(small.state_dict())
    message = str(caught.value)
    for needle in ("'tok_embeddings.weight'", "'output.weight'", "(67, 48)", "(68, 48)", str(tp)):
        assert needle in message, f"{needle!r} not in {message!r}"
    _unchanged(big, snapshot, "load_state_dict with other shapes")

    # The same shapes on another mesh.
    on_dp = torch_tp.parallelize_module(_TwoLayers(nn.Linear), mesh2d["dp"], {"up": torch_tp.ColwiseParallel()})
    on_tp = torch_tp.parallelize_module(_TwoLayers(nn.Linear), tp, {"up": torch_tp.ColwiseParallel()})
    snapshot = {n: _local(p).clone() for n, p in on_tp.named_parameters()}
    with pytest.raises(RuntimeError, match=r"'up.weight': the state dict's value is .* on DeviceMesh"):
        on_tp.load_state_dict(on_dp.state_dict())
    _unchanged(on_tp, snapshot, "load_state_dict from another mesh")

    # DCP: the planner refuses before reading anything.
    dcp.save(small.state_dict(), checkpoint_id=path)
    snapshot = {n: _local(p).clone() for n, p in big.named_parameters()}
    with pytest.raises(BaseException, match=r"Size mismatch between saved torch.Size\(\[67, 48\]\) and current: "
                                            r"torch.Size\(\[68, 48\]\) for (tok_embeddings|output).weight"):
        dcp.load(big.state_dict(), checkpoint_id=path)
    _unchanged(big, snapshot, "dcp.load with other shapes")


def test_bad_input(ranks, tmp_path):
    ranks(4).run(_check_bad_input, str(tmp_path / "ckpt"), timeout=300)
