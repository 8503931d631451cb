"""Hugging Face checkpoints read into shards and written back: ``torch_tp.parallel.load_pretrained``
and ``save_pretrained``.

Small float64 models are built from config and written by transformers' own ``save_pretrained``
(split into several files with an index, so the index path is the one taken). On each rank, the
reference is transformers' ``from_pretrained`` of that directory followed by
``parallelize_module``; torch_tp's copy is the same model built on the meta device, parallelized,
then ``load_pretrained``. Their parameters (each rank's local tensors) and buffers must be equal
bit for bit: loading only moves and casts data. The plans cover HF's strings (with tied
embeddings), torchtitan's sequence-parallel styles, packed blocks with 4, 2 and 1 KV heads, and a
Qwen3-MoE, whose per-expert checkpoint tensors transformers merges at load time, under its own
tp_plan (experts split by ExpertsTensorParallel), its ep_plan (whole experts per rank) and
ExpertTensorParallel on an (ep, tp) mesh of 2 x 2.

Then torch_tp's copy trains one AdamW step and is written by ``torch_tp.parallel.save_pretrained``:
transformers' ``from_pretrained`` must load that directory unsharded with exactly the gathered
parameters, and give the sharded model's logits (tolerance TOL: float64, sharded GEMMs sum in
another order, ~1e-15; a wrong slice costs O(1)). A directory saved at one degree loads at another.
"""

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import transformers  # noqa: F401  (a test dependency, pinned in scripts/run_tests.sh)

import torch_tp
from _compare import assert_close, assert_error_names
from test_generation import _sp_plan as sp_plan  # torchtitan's Llama plan on HF's module names
from torch_tp import ColwiseParallel

TOL = 1e-10
# How transformers builds every model here: float64, and HF's default MoE kernel (grouped_mm) has no
# float64 CPU kernel, so the experts run eagerly (a dense model ignores the setting).
HF_ARGS = dict(dtype=torch.float64, experts_implementation="eager")
# Small enough that every model here is written as several files and an index.
SHARD_SIZE = "40KB"


def _config(kind: str):
    from transformers import LlamaConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128, num_attention_heads=8)
    if kind == "llama":
        return LlamaConfig(num_key_value_heads=4, **sizes)
    if kind == "qwen3_tied":
        return Qwen3Config(head_dim=8, num_key_value_heads=4, tie_word_embeddings=True, **sizes)
    if kind.startswith("phi3"):  # "phi3_kv<n>": fused qkv_proj with n KV heads, fused gate_up_proj
        return Phi3Config(num_key_value_heads=int(kind[len("phi3_kv"):]), pad_token_id=0, bos_token_id=1,
                          eos_token_id=2, **{**sizes, "intermediate_size": 96})
    assert kind == "qwen3_moe", kind
    return Qwen3MoeConfig(head_dim=8, num_key_value_heads=4, moe_intermediate_size=32, num_experts=4,
                          num_experts_per_tok=2, **sizes)


def _save_reference(kind: str, path: str) -> None:
    """The unsharded model, float64, seed 0, written by transformers."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind), **HF_ARGS)
    model.save_pretrained(path, max_shard_size=SHARD_SIZE)


def _plan(model, plan: str):
    if plan == "hf":
        return model.tp_plan
    if plan == "ep":
        return model.ep_plan
    if plan == "sp":  # the logits gathered: HF's own loss takes them
        return dict(sp_plan(), lm_head=ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    assert plan == "packed", plan
    return torch_tp.parallel.packed_tp_plan(model)


def _parallel(model, plan: str):
    if plan == "ep_tp":  # the experts over (ep, tp), ExpertTensorParallel; the rest by the tp_plan over tp
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("ep", "tp"))
        torch_tp.parallelize_module(model, mesh, {"model.layers.*.mlp.experts": torch_tp.ExpertTensorParallel()})
        return torch_tp.parallelize_module(model, mesh["tp"], model.tp_plan)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return torch_tp.parallelize_module(model, mesh, _plan(model, plan))


def _meta_loaded(path: str, plan: str, **load_args):
    """Built on the meta device, parallelized, then loaded shard by shard."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), **HF_ARGS)
    _parallel(model, plan)
    result = torch_tp.parallel.load_pretrained(model, path, **load_args)
    assert result.missing_keys == [] and result.unexpected_keys == [], result
    return model


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _logits(model, ids):
    # HF takes positions from its input embedding, which under the SP plan is a sequence shard.
    logits = model(input_ids=ids, position_ids=torch.arange(ids.size(1)).unsqueeze(0)).logits
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def _check_load_and_save(kind: str, plan: str, path: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    what = f"{kind} under {plan} at {dist.get_world_size()} ranks"
    reference = _parallel(AutoModelForCausalLM.from_pretrained(path, **HF_ARGS), plan)
    ours = _meta_loaded(path, plan)
    if kind == "qwen3_tied":
        assert ours.lm_head.weight is ours.model.embed_tokens.weight, f"{what}: the tie was not kept"
    for (name, want), (got_name, got) in zip(reference.named_parameters(), ours.named_parameters(), strict=True):
        assert name == got_name and torch.equal(_local(got), _local(want)), f"{what}: parameter {name}"
    for (name, want), (_, got) in zip(reference.named_buffers(), ours.named_buffers(), strict=True):
        assert torch.equal(got, want), f"{what}: buffer {name}"
    assert ours.generation_config.to_dict() == reference.generation_config.to_dict(), what

    # One AdamW step, then written by torch_tp and read back by transformers, unsharded.
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 12))
    ours(input_ids=ids, labels=ids, position_ids=torch.arange(12).unsqueeze(0)).loss.backward()
    torch.optim.AdamW(ours.parameters(), lr=1e-3, eps=1e-4).step()
    torch_tp.parallel.save_pretrained(ours, out, max_shard_size=SHARD_SIZE)
    full = torch_tp.get_full_state_dict(ours)
    logits = _logits(ours, ids)
    back = AutoModelForCausalLM.from_pretrained(out, **HF_ARGS)
    assert set(back.state_dict()) == set(full), what
    for key, want in full.items():
        assert torch.equal(back.state_dict()[key], want), f"{what}: {key} after save_pretrained"
    assert_close(back(input_ids=ids).logits, logits, f"{what}: logits of the saved model", TOL)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert set(index["weight_map"]) == set(json.load(f)["weight_map"]), f"{what}: checkpoint names"


def _check_reload(kind: str, plan: str, out: str) -> None:
    """A directory torch_tp wrote at another degree, loaded shard by shard at this one."""
    from transformers import AutoModelForCausalLM

    ours = _meta_loaded(out, plan)
    unsharded = AutoModelForCausalLM.from_pretrained(out, **HF_ARGS)
    full = torch_tp.get_full_state_dict(ours)
    for key, want in unsharded.state_dict().items():
        assert torch.equal(full[key], want), f"{kind} reloaded at {dist.get_world_size()} ranks: {key}"
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    assert_close(_logits(ours, ids), unsharded(input_ids=ids).logits, f"{kind} reloaded: logits", TOL)
    prompt = ids[:1, :6]
    with torch.no_grad():
        runs = [model.generate(prompt, max_new_tokens=4, do_sample=False) for model in (unsharded, ours)]
    assert torch.equal(runs[1], runs[0]), f"{kind} reloaded: generated tokens"


# Where a directory torch_tp wrote is loaded again at another degree.
RELOAD_AT = {("llama", "hf", 2): 4, ("qwen3_tied", "hf", 2): 1, ("phi3_kv4", "packed", 2): 4,
             ("phi3_kv1", "packed", 2): 4, ("qwen3_moe", "hf", 2): 4, ("qwen3_moe", "ep", 2): 4}


@pytest.mark.parametrize("kind, plan, world_size", [
    ("llama", "hf", 1), ("llama", "hf", 2), ("llama", "hf", 4), ("qwen3_tied", "hf", 2), ("llama", "sp", 2),
    ("phi3_kv4", "packed", 2), ("phi3_kv1", "packed", 2), ("phi3_kv2", "packed", 4), ("qwen3_moe", "hf", 2),
    ("qwen3_moe", "ep", 2), ("qwen3_moe", "ep_tp", 4),
])
def test_load_and_save(ranks, tmp_path, kind, plan, world_size):
    path, out = str(tmp_path / "hf"), str(tmp_path / "torch_tp")
    _save_reference(kind, path)
    ranks(world_size).run(_check_load_and_save, kind, plan, path, out, timeout=300)
    if (kind, plan, world_size) in RELOAD_AT:
        ranks(RELOAD_AT[kind, plan, world_size]).run(_check_reload, kind, plan, out, timeout=300)


def _storage_is_file(tensor, path: str) -> bool:
    """Whether ``tensor``'s storage is a memory map of a whole file of ``path``."""
    sizes = {os.path.getsize(os.path.join(path, name)) for name in os.listdir(path) if name.endswith(".safetensors")}
    return tensor.untyped_storage().nbytes() in sizes and tensor.untyped_storage().nbytes() != tensor.nbytes


def _check_mapped_load(reference: str, path: str) -> None:
    """NOTE [local tensors that map the file] in pretrained.py: with mmap (the default) the one-range boxes are views
    of the file, the others copies, every value as mmap=False reads it; writes to the model never reach the file, and
    saving another model over the files leaves the mapped model as it was."""
    from transformers import AutoModelForCausalLM

    # torch_tp writes the files the mapped model maps, so that saving again writes the same file names.
    copied = _meta_loaded(reference, "hf", mmap=False)
    torch_tp.parallel.save_pretrained(copied, path, max_shard_size=SHARD_SIZE)
    mapped = _meta_loaded(path, "hf")
    attention = mapped.model.layers[0].self_attn
    assert _storage_is_file(_local(attention.q_proj.weight), path), "a Shard(0) piece was copied"
    assert _storage_is_file(mapped.model.norm.weight, path), "a replicated tensor was copied"
    assert not _storage_is_file(_local(attention.o_proj.weight), path), "a Shard(1) piece was mapped"
    assert not any(_storage_is_file(_local(p), path) for p in copied.parameters()), "mmap=False mapped a tensor"
    for (name, got), (_, want) in zip(mapped.named_parameters(), copied.named_parameters(), strict=True):
        assert torch.equal(_local(got), _local(want)), f"mapped {name}"

    # Writes copy the page they touch (copy-on-write): the file, and so a fresh load, is unchanged.
    with torch.no_grad():
        for param in mapped.model.layers[0].parameters():
            _local(param).add_(1.0)
    unsharded = AutoModelForCausalLM.from_pretrained(path, **HF_ARGS)
    for key, want in torch_tp.get_full_state_dict(copied).items():
        assert torch.equal(unsharded.state_dict()[key], want), f"the file changed under {key}"

    # The copies, changed otherwise, saved over the very files the mapped model maps: save_pretrained replaces
    # each file, so the mapped model's unwritten pages still hold the old values.
    expected = {key: value.clone() for key, value in torch_tp.get_full_state_dict(mapped).items()}
    with torch.no_grad():
        for param in copied.parameters():
            _local(param).mul_(2.0)
    before = sorted(os.listdir(path))
    torch_tp.parallel.save_pretrained(copied, path, max_shard_size=SHARD_SIZE)
    assert sorted(os.listdir(path)) == before, "the second save wrote other files"
    for key, value in torch_tp.get_full_state_dict(mapped).items():
        assert torch.equal(value, expected[key]), f"{key} of the mapped model changed when its file was replaced"
    reread = AutoModelForCausalLM.from_pretrained(path, **HF_ARGS).state_dict()
    for key, want in torch_tp.get_full_state_dict(copied).items():
        assert torch.equal(reread[key], want), f"{key} as saved over the mapped files"


def test_mapped_load(ranks, tmp_path):
    reference = str(tmp_path / "hf")
    _save_reference("llama", reference)
    ranks(2).run(_check_mapped_load, reference, str(tmp_path / "torch_tp"), timeout=300)


# ---------------------------------------------------------------- bad input (one process, no group)


def _meta(kind: str, **config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config(kind).__class__(**{**_config(kind).to_dict(), **config}),
                                                **HF_ARGS)


def _still_meta(model) -> bool:
    return all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def test_checkpoint_that_does_not_match(tmp_path):
    path = str(tmp_path / "hf")
    _save_reference("llama", path)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        down = json.load(f)["weight_map"]["model.layers.0.mlp.down_proj.weight"]

    wider = _meta("llama", intermediate_size=256)
    assert_error_names(lambda: torch_tp.parallel.load_pretrained(wider, path),
                       ["torch_tp.parallel.load_pretrained", "model.layers.0.mlp.down_proj.weight", down, "(64, 128)",
                        "(64, 256)", "nothing was loaded"])
    assert _still_meta(wider), "a failed load materialized the model"

    deeper = _meta("llama", num_hidden_layers=3)
    assert_error_names(lambda: torch_tp.parallel.load_pretrained(deeper, path),
                       ["missing from the checkpoint", "model.layers.2.self_attn.q_proj.weight",
                        "model.layers.2.mlp.down_proj.weight"])
    shallower = _meta("llama", num_hidden_layers=1)
    assert_error_names(lambda: torch_tp.parallel.load_pretrained(shallower, path),
                       ["not in the model", "model.layers.1.self_attn.q_proj.weight"])
    assert _still_meta(deeper) and _still_meta(shallower)

    # strict=False reports them, and initializes the missing layer as from_pretrained does.
    result = torch_tp.parallel.load_pretrained(deeper, path, strict=False)
    assert "model.layers.2.mlp.up_proj.weight" in result.missing_keys and result.unexpected_keys == []
    assert not _still_meta(deeper) and torch.isfinite(deeper.model.layers[2].mlp.up_proj.weight).all()


def test_missing_and_corrupt_files(tmp_path):
    model = _meta("llama")
    assert_error_names(lambda: torch_tp.parallel.load_pretrained(model, str(tmp_path / "nowhere")),
                       ["torch_tp.parallel.load_pretrained", "no such directory", "nowhere"], FileNotFoundError)
    assert_error_names(lambda: torch_tp.parallel.load_pretrained(model, str(tmp_path)),
                       ["model.safetensors.index.json", "model.safetensors", str(tmp_path)], FileNotFoundError)

    path = str(tmp_path / "hf")
    _save_reference("llama", path)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    victim = os.path.join(path, files[1])
    with open(victim, "rb") as f:
        data = f.read()
    with open(victim, "wb") as f:
        f.write(data[:len(data) // 2])  # truncated: the header promises more bytes than the file has
    assert_error_names(lambda: torch_tp.parallel.load_pretrained(model, path),
                       ["torch_tp.parallel.load_pretrained", victim, "truncated or corrupt"])
    os.remove(victim)
    assert_error_names(lambda: torch_tp.parallel.load_pretrained(model, path),
                       ["the index lists", victim, "does not exist"], FileNotFoundError)
    assert _still_meta(model)


def test_save_writes_what_transformers_writes(tmp_path):
    """Unparallelized, torch_tp's save_pretrained writes transformers' files: the same names in
    the same shards, the same tensors, the same config."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    theirs, ours = str(tmp_path / "hf"), str(tmp_path / "torch_tp")
    _save_reference("qwen3_moe", theirs)
    model = AutoModelForCausalLM.from_pretrained(theirs, **HF_ARGS)
    torch_tp.parallel.save_pretrained(copy.deepcopy(model), ours, max_shard_size=SHARD_SIZE)
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    for name in os.listdir(theirs):
        if name.endswith(".safetensors"):
            want, got = load_file(os.path.join(theirs, name)), load_file(os.path.join(ours, name))
            assert set(got) == set(want), name
            assert all(torch.equal(got[key], want[key]) for key in want), name
        else:
            with open(os.path.join(theirs, name)) as f, open(os.path.join(ours, name)) as g:
                assert json.load(g) == json.load(f), name


def test_box_byte_runs():
    """The runs load_pretrained reads a box by (NOTE [reading a box straight into its tensor]) hold
    exactly the box's elements in its row-major order, for every box of small shapes up to 3-D."""
    from itertools import product

    from torch_tp.parallel.pretrained import _element_runs

    for shape in [(), (5,), (3, 4), (1, 4), (2, 3, 4), (4, 1, 3)]:
        full = torch.arange(max(1, torch.Size(shape).numel())).reshape(shape)
        ranges = [[(start, length) for start in range(size) for length in range(1, size - start + 1)]
                  for size in shape]
        for box in product(*ranges):
            want = full
            for dim, (start, length) in enumerate(box):
                want = want.narrow(dim, start, length)
            starts, run = _element_runs(shape, box)
            got = torch.cat([full.reshape(-1)[first:first + run] for first in starts])
            assert torch.equal(got, want.reshape(-1)), (shape, box)
