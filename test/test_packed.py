"""PackedColwiseParallel and PackedRowwiseParallel against the unsharded model.

The model is an attention block with a fused GQA ``qkv_proj`` (8 query heads,
4 KV heads of 4: rows [q 32 | k 16 | v 16], with bias) whose forward splits
its local output with local head counts derived from the shapes, an
``o_proj`` (RowwiseParallel), and an MLP with a fused ``gate_up_proj``
(PackedColwiseParallel(2)) and ``down_proj`` (RowwiseParallel), in float64,
at 1, 2 and 4 ranks (every block divides by 4); and a packed up-projection
into a PackedRowwiseParallel down-projection, plain and sequence parallel.
Expected local pieces are cut here from the unsharded tensors
(``_packed_piece``: chunk r of every block, in block order), independently
of torch_tp's own reordering. State dicts must be the unsharded model's
(natural order) through ``state_dict()``, get/load_full_state_dict, DCP
resharding (TP 2 -> unsharded, TP 1 and 4, torch's own TP, FSDP2 x TP) and
the optimizer's state dicts (the same AdamW states at every degree).

Tolerances:

- TOL = 1e-12 of each tensor's largest magnitude, for what the model
  computes (outputs, loss, gradients, parameters and AdamW states after a
  step): the sharded GEMMs and the all-reduce over ranks add the same
  products in another order. In float64 (eps 1.1e-16) sums of at most 64
  products of O(1) terms are within ~1e-14 of each other, and 1e-12 is ten
  orders of magnitude below a misplaced block. AdamW's first step moves a
  weight by lr * g / (|g| + eps), which amplifies an absolute gradient
  roundoff by up to lr / eps where |g| is small, and the key bias's exact
  gradient is zero (softmax ignores a shift shared by all keys), so its
  roundoff (~1e-17) has either sign: with lr=1e-2 and eps=1e-4 (not the
  default 1e-8, which moved it by 8e-12) the factor is 100, and the
  parameters and states after a step stay within TOL.
- State dicts, checkpoints and optimizer states that were only moved
  (gathered, reordered, cut, saved, loaded) are compared bitwise
  (torch.equal).
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed.tensor.parallel as torch_api
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import torch_tp
from torch_tp.parallel.checkpoint import get_full_state_dict, load_full_state_dict
from torch_tp.parallel.packed import PackedColwiseParallel, PackedRowwiseParallel

from _compare import assert_close, assert_error_names

TOL = 1e-12

N_HEADS, N_KV_HEADS, HEAD_DIM = 8, 4, 4
GROUP = N_HEADS // N_KV_HEADS  # query heads per KV head
DIM, HIDDEN, SEQ = 24, 24, 6
QKV_BLOCKS = [N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM]  # [q | k | v]
# The packed parameters of Model: their blocks along dim 0.
PACKED = {
    "attn.qkv_proj.weight": QKV_BLOCKS,
    "attn.qkv_proj.bias": QKV_BLOCKS,
    "mlp.gate_up_proj.weight": [HIDDEN, HIDDEN],
    "mlp.gate_up_proj.bias": [HIDDEN, HIDDEN],
}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(DIM, sum(QKV_BLOCKS))
        self.o_proj = nn.Linear(N_HEADS * HEAD_DIM, DIM)

    def forward(self, x):
        qkv = self.qkv_proj(x)  # [b, s, kv_heads * (GROUP + 2) * HEAD_DIM], this rank's heads
        kv_heads = qkv.size(-1) // ((GROUP + 2) * HEAD_DIM)
        q, k, v = qkv.split([kv_heads * GROUP * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], -1)
        b, s = x.shape[:2]
        q, k, v = (t.view(b, s, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(GROUP, dim=1), v.repeat_interleave(GROUP, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(DIM, 2 * HIDDEN)
        self.down_proj = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.mlp = MLP()

    def forward(self, x):
        h = x + self.attn(x)
        return h + self.mlp(h)


def _plan():
    return {"attn.qkv_proj": PackedColwiseParallel(QKV_BLOCKS), "attn.o_proj": torch_tp.RowwiseParallel(),
            "mlp.gate_up_proj": PackedColwiseParallel(2), "mlp.down_proj": torch_tp.RowwiseParallel()}


def _torch_plan():
    """torch's own TP: ColwiseParallel on the fused Linears (Shard(0) of the natural rows).
    Its forward would split the heads wrongly; it is only loaded into."""
    return {"attn.qkv_proj": torch_api.ColwiseParallel(), "attn.o_proj": torch_api.RowwiseParallel(),
            "mlp.gate_up_proj": torch_api.ColwiseParallel(), "mlp.down_proj": torch_api.RowwiseParallel()}


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _models(seed=0, lib="torch_tp"):
    """(the unsharded float64 model, a copy parallelized by ``lib``: torch_tp, torch, None, or
    fsdp2: torch_tp on mesh["tp"] and FSDP2 over mesh["dp"], 2 x world/2, torchtitan's 2-D recipe)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    reference = Model().double()
    parallel = copy.deepcopy(reference)
    if lib == "torch_tp":
        torch_tp.parallelize_module(parallel, _mesh(), _plan())
    elif lib == "torch":
        torch_api.parallelize_module(parallel, _mesh(), _torch_plan())
    elif lib == "fsdp2":
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
        torch_tp.parallelize_module(parallel, mesh["tp"], _plan())
        fully_shard(parallel, mesh=mesh["dp"])
    return reference, parallel


def _input(step=0):
    return torch.randn(2, SEQ, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + step))


def _loss(out):
    return out.square().mean()


def _packed_piece(full, blocks, dim, rank, degree):
    """Rank ``rank``'s local tensor of a packed tensor: chunk ``rank`` of every block, in block order."""
    return torch.cat([block.chunk(degree, dim)[rank] for block in full.split(blocks, dim)], dim)


def _expected_local(name, full, param):
    """This rank's local tensor of parameter (or state) ``name`` whose unsharded value is ``full``."""
    rank, degree = dist.get_rank(), dist.get_world_size()
    if name in PACKED:
        return _packed_piece(full, PACKED[name], 0, rank, degree)
    if isinstance(param, DTensor) and isinstance(param.placements[0], Shard):
        return full.chunk(degree, param.placements[0].dim)[rank]
    return full


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)


def _train_step(model, optimizer, step=0):
    loss = _loss(model(_input(step)))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _assert_natural_state_dict(model, expected, what):
    """``model.state_dict()`` holds, for each DTensor parameter, the DTensor
    ``distribute_tensor(unsharded, mesh, placements)`` gives: the parameter's mesh and
    placements, the unsharded model's values (bitwise), its natural torch.chunk pieces."""
    state = model.state_dict()
    assert list(state) == list(expected), f"{what}: keys {list(state)} != {list(expected)}"
    params = dict(model.named_parameters())
    for key, value in state.items():
        param = params[key]
        assert isinstance(value, DTensor) and value.placements == param.placements, (what, key, value)
        assert value.device_mesh == param.device_mesh and value.shape == param.shape, (what, key)
        assert torch.equal(value.full_tensor(), expected[key]), f"{what}: {key} differs from the unsharded value"
        natural = expected[key]
        if isinstance(param.placements[0], Shard):
            natural = natural.chunk(dist.get_world_size(), param.placements[0].dim)[dist.get_rank()]
        assert torch.equal(value.to_local(), natural), f"{what}: {key} is not the natural piece"


# ---------------------------------------------------------------- against the unsharded model


def _assert_full_states_close(parallel, opt, reference, ref_opt, what):
    """The full model and optimizer state dicts (torch's get_state_dict, full_state_dict=True) of the
    parallel model and of the unsharded reference agree; returns the parallel model's."""
    full_model, full_optim = get_state_dict(parallel, opt, options=StateDictOptions(full_state_dict=True))
    ref_model, ref_optim = get_state_dict(reference, ref_opt, options=StateDictOptions(full_state_dict=True))
    for key, value in ref_model.items():
        assert_close(full_model[key], value, f"{what}: {key}", TOL)
    for fqn, states in ref_optim["state"].items():
        for key, value in states.items():
            assert_close(full_optim["state"][fqn][key], value, f"{what}: optimizer state {fqn}.{key}", TOL)
    return full_model, full_optim


def _check_matches_unsharded():
    reference, parallel = _models()
    params = dict(parallel.named_parameters())
    for name, param in reference.named_parameters():
        # The parameters are DTensors of the module's global shape; packed ones hold [q_r | k_r | v_r].
        assert params[name].shape == param.shape, name
        assert torch.equal(_local(params[name]).detach(), _expected_local(name, param.detach(), params[name])), name
    _assert_natural_state_dict(parallel, reference.state_dict(), "state_dict() before training")
    assert "PackedColwiseParallel" in repr(parallel.attn.qkv_proj) and "blocks=(32, 16, 16)" in repr(parallel)

    x = _input()
    expected_out, out = reference(x), parallel(x)
    assert_close(out, expected_out, "output", TOL)
    expected_loss, loss = _loss(expected_out), _loss(out)
    assert_close(loss, expected_loss, "loss", TOL)
    expected_loss.backward()
    loss.backward()
    for name, param in reference.named_parameters():
        grad = params[name].grad
        assert isinstance(grad, DTensor) and grad.placements == params[name].placements, (name, grad)
        assert_close(grad.to_local(), _expected_local(name, param.grad, params[name]), f"grad {name}", TOL)

    ref_opt, opt = _adamw(reference), _adamw(parallel)
    ref_opt.step()
    opt.step()
    for name, param in reference.named_parameters():
        assert_close(_local(params[name]).detach(), _expected_local(name, param.detach(), params[name]),
                     f"{name} after AdamW", TOL)
        for key in ("exp_avg", "exp_avg_sq"):
            state = opt.state[params[name]][key]
            assert_close(state.to_local(), _expected_local(name, ref_opt.state[param][key], params[name]),
                         f"AdamW {key} of {name}", TOL)

    # The optimizer's full state dict is the unsharded optimizer's, in the natural order.
    full = get_optimizer_state_dict(parallel, opt, options=StateDictOptions(full_state_dict=True))
    expected = get_optimizer_state_dict(reference, ref_opt, options=StateDictOptions(full_state_dict=True))
    for fqn, states in expected["state"].items():
        for key, value in states.items():
            assert_close(full["state"][fqn][key], value, f"full optimizer state {fqn}.{key}", TOL)

    # get_full_state_dict / load_full_state_dict: the unsharded model's state dict (after the step
    # within TOL, as computed values; loaded and gathered back, bitwise).
    got = get_full_state_dict(parallel)
    for key, value in reference.state_dict().items():
        assert_close(got[key], value, f"get_full_state_dict {key} after AdamW", TOL)
    other, _ = _models(seed=1)
    load_full_state_dict(parallel, other.state_dict())
    got = get_full_state_dict(parallel)
    assert list(got) == list(other.state_dict())
    for key, value in other.state_dict().items():
        assert torch.equal(got[key], value), f"get_full_state_dict(load_full_state_dict(sd)) {key}"
        assert torch.equal(_local(params[key]).detach(), _expected_local(key, value, params[key])), key
    _assert_natural_state_dict(parallel, other.state_dict(), "state_dict() after load_full_state_dict")
    # load_state_dict of its own (natural DTensor) state dict changes nothing.
    before = {name: _local(p).detach().clone() for name, p in params.items()}
    parallel.load_state_dict(parallel.state_dict())
    for name, param in params.items():
        assert torch.equal(_local(param).detach(), before[name]), f"load_state_dict(state_dict()) changed {name}"
    # The loaded model computes what the unsharded one computes.
    assert_close(parallel(x), other(x), "output after load_full_state_dict", TOL)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matches_unsharded(ranks, world_size):
    ranks(world_size).run(_check_matches_unsharded, timeout=300)


def _check_fsdp2():
    """FSDP2 over dp x torch_tp over tp (every rank on the same input): the state dict keeps the
    parameters' 2-D placements in the natural order, and a step and the full optimizer state
    are the unsharded model's."""
    reference, parallel = _models(lib="fsdp2")
    state, params = parallel.state_dict(), dict(parallel.named_parameters())
    for key, value in reference.state_dict().items():
        assert state[key].placements == params[key].placements and params[key].device_mesh.ndim == 2, key
        assert torch.equal(state[key].full_tensor(), value), f"FSDP2 x TP state_dict() {key}"
    ref_opt, opt = _adamw(reference), _adamw(parallel)
    expected_loss, loss = _train_step(reference, ref_opt), _train_step(parallel, opt)
    assert_close(loss, expected_loss, "FSDP2 x TP loss", TOL)
    _assert_full_states_close(parallel, opt, reference, ref_opt, "FSDP2 x TP after AdamW")


def test_fsdp2_tp_2d(ranks):
    ranks(4).run(_check_fsdp2, timeout=300)


# ---------------------------------------------------------------- PackedRowwiseParallel


class _UpDown(nn.Module):
    """A fused up-projection into [a | b] and a down-projection of its (elementwise-activated) output."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _check_rowwise(sequence_parallel):
    """PackedColwiseParallel(2) into PackedRowwiseParallel([HIDDEN, HIDDEN]); with
    ``sequence_parallel`` the input is this rank's sequence shard (gathered by the packed
    colwise op) and the output is reduce-scattered along the sequence (Shard(1))."""
    torch.manual_seed(0)
    reference = _UpDown().double()
    parallel = copy.deepcopy(reference)
    sequence = Shard(1) if sequence_parallel else None
    torch_tp.parallelize_module(parallel, _mesh(), {
        "up": PackedColwiseParallel(2, input_layouts=sequence),
        "down": PackedRowwiseParallel([HIDDEN, HIDDEN], output_layouts=sequence)})
    rank, degree = dist.get_rank(), dist.get_world_size()
    weight = parallel.down.weight
    assert weight.placements == (Shard(1),) and parallel.down.bias.placements == (Replicate(),)
    assert torch.equal(weight.to_local().detach(), _packed_piece(reference.down.weight.detach(), [HIDDEN] * 2, 1,
                                                                  rank, degree))
    _assert_natural_state_dict(parallel, reference.state_dict(), "state_dict()")
    x = torch.randn(2, 8, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(7))  # 8: divides by 4
    expected_out = reference(x)
    if sequence_parallel:
        expected_out_local, out = expected_out.chunk(degree, 1)[rank], parallel(x.chunk(degree, 1)[rank])
    else:
        expected_out_local, out = expected_out, parallel(x)
    assert_close(out, expected_out_local, "output", TOL)
    # Each rank's loss is its share of the unsharded sum: the gradients are the unsharded loss's.
    expected_out.square().sum().backward()
    out.square().sum().backward()
    assert_close(weight.grad.to_local(), _packed_piece(reference.down.weight.grad, [HIDDEN] * 2, 1, rank, degree),
                 "down.weight grad", TOL)
    assert_close(parallel.up.weight.grad.to_local(),
                 _packed_piece(reference.up.weight.grad, [HIDDEN] * 2, 0, rank, degree), "up.weight grad", TOL)
    if not sequence_parallel:
        assert_close(parallel.down.bias.grad.to_local(), reference.down.bias.grad, "down.bias grad", TOL)
    # A DTensor input would be read in the natural order: refused.
    assert_error_names(lambda: parallel.down(DTensor.from_local(torch.zeros(2, 2 * HIDDEN // degree,
                                                                            dtype=torch.float64),
                                                                _mesh(), [Shard(1)])),
                       ["PackedRowwiseParallelLinear", "not a DTensor"], TypeError)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_packed_rowwise_matches_unsharded(ranks, world_size, sequence_parallel):
    ranks(world_size).run(_check_rowwise, sequence_parallel, timeout=300)


# ---------------------------------------------------------------- DCP across TP degrees


def _dcp_save(path):
    """torch_tp at this degree: one AdamW step, then model and optimizer saved with DCP; the
    full state dicts (checked against the unsharded model) go to ``path``.expected.pt."""
    reference, parallel = _models()
    ref_opt, opt = _adamw(reference), _adamw(parallel)
    _train_step(reference, ref_opt)
    _train_step(parallel, opt)
    model_state, optim_state = get_state_dict(parallel, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    full_model, full_optim = _assert_full_states_close(parallel, opt, reference, ref_opt, "saved")
    if dist.get_rank() == 0:
        torch.save({"model": full_model, "optim": full_optim}, path + ".expected.pt")


def _dcp_load(path, lib):
    """A model of other weights, parallelized by ``lib`` (torch_tp, torch, or None: unsharded)
    at this degree, loads the checkpoint: its parameters and optimizer states are bitwise the
    saved ones, and each rank holds its expected piece."""
    _, model = _models(seed=1, lib=lib)
    optimizer = _adamw(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    expected = torch.load(path + ".expected.pt", weights_only=False)

    full_model, full_optim = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    assert list(full_model) == list(expected["model"])
    for key, value in expected["model"].items():
        assert torch.equal(full_model[key], value), f"{lib}: {key} after loading"
    for fqn, states in expected["optim"]["state"].items():
        for key, value in states.items():
            assert torch.equal(full_optim["state"][fqn][key], value), f"{lib}: optimizer state {fqn}.{key}"
    if lib == "fsdp2":
        return  # its pieces are FSDP2's (_StridedShard over dp, then Shard over tp): compared as full tensors
    # What the parameters and the optimizer hold, piece by piece (cut here, not by torch_tp).
    for name, param in model.named_parameters():
        want = expected["model"][name]
        if lib == "torch":  # torch's TP: natural torch.chunk pieces
            want = want if isinstance(param.placements[0], Replicate) else \
                want.chunk(dist.get_world_size(), param.placements[0].dim)[dist.get_rank()]
        elif lib == "torch_tp":
            want = _expected_local(name, want, param)
        assert torch.equal(_local(param).detach(), want), f"{lib}: local piece of {name}"
        if lib == "torch_tp":
            for key in ("exp_avg", "exp_avg_sq"):
                state = optimizer.state[param][key]
                assert torch.equal(_local(state), _expected_local(name, expected["optim"]["state"][name][key],
                                                                  param)), f"{lib}: {key} of {name}"


def test_dcp_reshards_across_tp_degrees(ranks, tmp_path):
    """Saved by torch_tp at TP 2; loaded into the unsharded model, into torch_tp at TP 4 and 1,
    into torch's own TP at 4, and into FSDP2 (dp 2) x torch_tp (TP 2)."""
    path = str(tmp_path / "tp2")
    ranks(2).run(_dcp_save, path, timeout=300)
    ranks(1).run(_dcp_load, path, None, timeout=300)
    ranks(1).run(_dcp_load, path, "torch_tp", timeout=300)
    ranks(4).run(_dcp_load, path, "torch_tp", timeout=300)
    ranks(4).run(_dcp_load, path, "torch", timeout=300)
    ranks(4).run(_dcp_load, path, "fsdp2", timeout=300)


# ---------------------------------------------------------------- optimizer state outside DCP


def _check_optimizer_load_before_first_step():
    """An optimizer that loads a state dict before its first step (no hooks yet) and one that
    has them both continue bitwise as the optimizer the state dict came from."""
    _, model = _models()
    optimizer = _adamw(model)
    _train_step(model, optimizer, 0)
    saved = copy.deepcopy(optimizer.state_dict())  # natural order, as every optimizer state dict
    # An optimizer with hooks: load_state_dict(state_dict()) changes nothing.
    live = {id(p): {k: _local(v).clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    optimizer.load_state_dict(copy.deepcopy(saved))
    for param, states in optimizer.state.items():
        for key, value in states.items():
            assert torch.equal(_local(value), live[id(param)][key]), key

    _, fresh = _models()
    fresh.load_state_dict(model.state_dict())
    fresh_optimizer = _adamw(fresh)
    fresh_optimizer.load_state_dict(saved)  # before any step: no hooks; reordered at its first step
    for step in (1, 2):
        _train_step(model, optimizer, step)
        _train_step(fresh, fresh_optimizer, step)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(_local(a), _local(b)), f"{name} after resuming"
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(_local(optimizer.state[a][key]), _local(fresh_optimizer.state[b][key])), (name, key)

    # torch.save(model): the pickled model is packed too (its state dict, its forward).
    blob = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"torch_tp_packed_model_{os.getpid()}.pt")
    torch.save(model, blob)
    loaded = torch.load(blob, weights_only=False)
    os.remove(blob)
    assert type(loaded.attn.qkv_proj).__name__ == "PackedColwiseParallelLinear"
    expected = get_full_state_dict(model)
    for key, value in get_full_state_dict(loaded).items():
        assert torch.equal(value, expected[key]), f"pickled model: {key}"
    assert torch.equal(loaded(_input(5)), model(_input(5)))


@pytest.mark.parametrize("world_size", [2])
def test_optimizer_load_before_first_step(ranks, world_size):
    ranks(world_size).run(_check_optimizer_load_before_first_step, timeout=300)


def _check_meta_init():
    """Meta-device initialization: parallelized on meta, materialized with to_empty (new
    parameter objects), then loaded from the unsharded state dict."""
    reference, _ = _models()
    with torch.device("meta"):
        model = Model().double()
    torch_tp.parallelize_module(model, _mesh(), _plan())
    model.to_empty(device="cpu")
    load_full_state_dict(model, reference.state_dict())
    _assert_natural_state_dict(model, reference.state_dict(), "meta-initialized model")
    assert_close(model(_input()), reference(_input()), "output of the meta-initialized model", TOL)


@pytest.mark.parametrize("world_size", [2])
def test_meta_init(ranks, world_size):
    ranks(world_size).run(_check_meta_init)


# ---------------------------------------------------------------- errors


def _check_errors():
    mesh = _mesh()

    def apply(style, path="attn.qkv_proj"):
        torch_tp.parallelize_module(Model().double(), mesh, {path: style})

    assert_error_names(lambda: apply(PackedColwiseParallel([32, 16, 8])),
                       ["torch_tp.PackedColwiseParallel", "'attn.qkv_proj'", "(32, 16, 8)", "add up to 56",
                        "not 64"], ValueError)
    assert_error_names(lambda: apply(PackedColwiseParallel(3)),
                       ["torch_tp.PackedColwiseParallel", "'attn.qkv_proj'", "out_features=64", "blocks=3"],
                       ValueError)
    assert_error_names(lambda: apply(PackedColwiseParallel([33, 15, 16])),
                       ["torch_tp.PackedColwiseParallel", "'attn.qkv_proj'", "(33, 15, 16)", "2 ranks",
                        "[33, 15]"], ValueError)
    assert_error_names(lambda: apply(PackedRowwiseParallel([20, 13]), "attn.o_proj"),
                       ["torch_tp.PackedRowwiseParallel", "'attn.o_proj'", "in_features=32", "add up to 33"],
                       ValueError)
    assert_error_names(lambda: PackedColwiseParallel(2, output_layouts=Replicate()),
                       ["torch_tp.PackedColwiseParallel", "output_layouts=Replicate()", "Shard(-1)",
                        "per-rank order"], ValueError)
    assert_error_names(lambda: PackedColwiseParallel(2, use_local_output=False),
                       ["torch_tp.PackedColwiseParallel", "use_local_output=False", "per-rank order"], ValueError)
    assert_error_names(lambda: PackedRowwiseParallel(2, input_layouts=Replicate()),
                       ["torch_tp.PackedRowwiseParallel", "input_layouts=Replicate()", "Shard(-1)"], ValueError)
    assert_error_names(lambda: PackedColwiseParallel([32, 0]), ["torch_tp.PackedColwiseParallel", "positive"],
                       ValueError)
    assert_error_names(lambda: PackedColwiseParallel(2.0), ["torch_tp.PackedColwiseParallel", "blocks", "2.0"],
                       TypeError)
    assert_error_names(lambda: torch_tp.parallelize_module(nn.Embedding(8, 4), mesh, PackedColwiseParallel(2)),
                       ["torch_tp.PackedColwiseParallel", "nn.Linear", "Embedding"], NotImplementedError)
    assert repr(PackedColwiseParallel([32, 16, 16])) == (
        "PackedColwiseParallel((32, 16, 16), input_layouts=(Replicate(),), output_layouts=(Shard(dim=-1),), "
        "use_local_output=True)")
    # num_kv_heads: the blocks of an attention, whole heads, heads and ranks dividing one another.
    assert_error_names(lambda: PackedColwiseParallel(2, num_kv_heads=1),
                       ["torch_tp.PackedColwiseParallel", "num_kv_heads=1", "[q, k, v]", "got 2"], ValueError)
    assert_error_names(lambda: PackedColwiseParallel([32, 16, 16], num_kv_heads=3),
                       ["torch_tp.PackedColwiseParallel", "num_kv_heads=3", "(32, 16, 16)"], ValueError)
    assert_error_names(lambda: PackedColwiseParallel([32, 16, 16], num_kv_heads=0),
                       ["torch_tp.PackedColwiseParallel", "num_kv_heads", "positive", "0"], ValueError)
    assert_error_names(lambda: apply(PackedColwiseParallel([40, 12, 12], num_kv_heads=3)),
                       ["torch_tp.PackedColwiseParallel", "'attn.qkv_proj'", "3 KV heads", "2 ranks"], ValueError)
    assert "num_kv_heads=1" in repr(PackedColwiseParallel([32, 16, 16], num_kv_heads=1))


@pytest.mark.parametrize("world_size", [2])
def test_errors(ranks, world_size):
    ranks(world_size).run(_check_errors)
