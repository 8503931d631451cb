"""torch_tp/_torch_private.py: every private torch symbol torch_tp uses, against real objects.

Run on the oldest and the newest supported torch (2.11 and 2.15): a symbol that
moved or changed behaviour fails here, by name, rather than deep in a test of a
feature. One process; a gloo group of one rank where a group is needed.
"""

import ast
import pathlib
import re
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard

import torch_tp
from torch_tp import _torch_private as private


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def mesh(group):
    return init_device_mesh("cpu", (1,))


def test_missing_symbol_is_named():
    version = re.escape(torch.__version__)
    with pytest.raises(ImportError, match=rf"torch\._no_such_symbol, which torch {version} does not have"):
        private._lookup("torch", "_no_such_symbol")
    with pytest.raises(ImportError, match=r"torch\.no_such_module\.x"):
        private._lookup("torch.no_such_module", "x")


def _is_private(name: str) -> bool:
    # torch._foreach_* are public ops (the rule in _torch_private's docstring); dunders are Python's.
    return name.startswith("_") and not name.startswith(("__", "_foreach_"))


def _private_torch_uses(path: pathlib.Path):
    """``(line, text)`` for each private torch name ``path`` reaches directly: an import from a
    private module or of a private name, an attribute chain from a name bound to something of
    torch's with a private part (torch_tp's own ops, ``torch.ops.torch_tp._*``, are not torch's),
    or DTensor's private attributes on any object."""
    tree = ast.parse(path.read_text())
    torch_names = set()  # local names bound by `import torch...` or `from torch... import`
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names.update(alias.asname or "torch" for alias in node.names if alias.name.split(".")[0] == "torch")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "torch":
            torch_names.update(alias.asname or alias.name for alias in node.names)
            if any(map(_is_private, node.module.split(".") + [alias.name for alias in node.names])):
                yield node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain, root = [], node
        while isinstance(root, ast.Attribute):
            chain.insert(0, root.attr)
            root = root.value
        if isinstance(root, ast.Name) and root.id in torch_names and any(map(_is_private, chain)) \
                and chain[:2] != ["ops", "torch_tp"]:
            yield node.lineno, ".".join([root.id] + chain)
        elif any(part in ("_local_tensor", "_spec") for part in chain):
            yield node.lineno, "." + ".".join(chain)


def test_private_torch_only_through_the_seam():
    """Only _torch_private.py reaches torch's private names (its docstring lists the exceptions,
    which are not torch-module attribute chains or are the public ``torch._foreach_*`` ops)."""
    package = pathlib.Path(torch_tp.__file__).parent
    uses = [f"{path.relative_to(package)}:{line}: {text}"
            for path in sorted(package.rglob("*.py")) if path.name != "_torch_private.py"
            for line, text in _private_torch_uses(path)]
    assert not uses, "private torch names used outside torch_tp/_torch_private.py:\n" + "\n".join(uses)


# ---------------------------------------------------------------- process groups


def test_process_groups(group):
    default = private.get_default_group()
    assert isinstance(default, dist.ProcessGroup)
    assert (default.rank(), default.size()) == (0, 1)
    resolved = private.resolve_process_group(default.group_name)
    assert resolved.group_name == default.group_name
    assert (resolved.rank(), resolved.size()) == (0, 1)


# ---------------------------------------------------------------- DTensor internals


def test_dtensor_internals(mesh):
    local = torch.arange(6.0).reshape(3, 2)
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    assert private.dtensor_local(dt).data_ptr() == local.data_ptr()
    assert private.dtensor_local(dt).grad_fn is None
    spec = private.dtensor_spec(dt)
    assert isinstance(spec, private.DTensorSpec)
    assert spec.mesh is mesh and spec.placements == (Shard(0),)
    assert (spec.shape, spec.stride) == (dt.shape, dt.stride())
    # _layout.py: a spec built from its parts describes the same DTensor.
    built = private.DTensorSpec(mesh, (Shard(0),), tensor_meta=private.TensorMeta(dt.shape, dt.stride(), dt.dtype))
    assert built == spec

    # _params.py: a Partial twin of a spec, kept in a WeakKeyDictionary while the spec lives.
    twin = private.DTensorSpec(spec.mesh, (Partial(),), tensor_meta=spec.tensor_meta)
    twins = weakref.WeakKeyDictionary({spec: twin})
    assert twins[spec] is twin and twin.shape == spec.shape

    grad = torch.ones(3, 2)
    wrapped = private.dtensor_from_spec(grad, twin, requires_grad=False)
    assert isinstance(wrapped, DTensor) and wrapped.placements == (Partial(),)
    assert private.dtensor_local(wrapped) is grad
    assert wrapped.grad_fn is None and not wrapped.requires_grad
    # _layout.py's handed DTensors: the same for a DTensor subclass, and a leaf that requires grad.
    Sub = type("Sub", (DTensor,), {})
    made = private.dtensor_from_spec(grad, spec, requires_grad=True, subclass=Sub)
    assert type(made) is Sub and made.placements == (Shard(0),) and made.shape == dt.shape
    assert private.dtensor_local(made) is grad and made.requires_grad and made.grad_fn is None
    # _params.py's gradient constructor, called by the unwrap's C++ node: the same DTensor as
    # dtensor_from_spec's, with no graph.
    constructed = private.dtensor_constructor(requires_grad=False)(grad, twin)
    assert type(constructed) is DTensor and constructed.placements == (Partial(),)
    assert constructed.shape == wrapped.shape and constructed.stride() == wrapped.stride()
    assert private.dtensor_local(constructed) is grad
    assert constructed.grad_fn is None and not constructed.requires_grad


def test_dtensor_accessors_trace_under_compile(mesh):
    """A forward without grad unwraps each parameter through dtensor_local; compiled blocks
    (torchtitan's ``fullgraph=True``) must trace it."""
    weight = DTensor.from_local(torch.ones(4, 3), mesh, [Shard(0)], run_check=False)
    x = torch.ones(2, 4)
    with torch.no_grad():
        compiled = torch.compile(lambda x, w: x @ private.dtensor_local(w), fullgraph=True, backend="eager")
        assert torch.equal(compiled(x, weight), torch.full((2, 3), 4.0))


def test_local_tensor_mode():
    local = private.LocalTensor({0: torch.ones(2), 1: torch.zeros(2)})
    assert isinstance(local, torch.Tensor) and local.shape == (2,)
    with private.LocalTensorMode(2):
        assert isinstance(torch.ones(2), private.LocalTensor)
    # ops.py registers the refusal on both (NOTE [refused under LocalTensorMode]).
    with pytest.raises(NotImplementedError, match="LocalTensorMode"):
        torch.ops.torch_tp.all_reduce(local, "sum", "no group needed")


def test_current_mesh(mesh):
    assert private.current_mesh() is None
    with mesh:
        assert private.current_mesh() is mesh
    assert private.current_mesh() is None


# ---------------------------------------------------------------- autograd


def test_queue_autograd_callback():
    events = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2

    def hook(grad):
        events.append("hook")
        private.queue_autograd_callback(lambda: events.append("end of backward"))

    y.register_hook(hook)
    (y * 3).sum().backward()
    assert events == ["hook", "end of backward"]


def test_assert_async():
    private.assert_async(torch.tensor(True), "not raised")
    with pytest.raises(RuntimeError, match="target out of range"):
        private.assert_async(torch.tensor(False), "target out of range")


def test_import_registers_rules_for_its_own_ops_only():
    """Importing torch_tp changes no behaviour of torch's own ops: every torch_dispatch rule it registers
    (torch.library's open registry, which DTensor and other subclasses consult) is for a torch_tp op."""
    from torch._library.simple_registry import singleton

    with_rules = [name for name, entry in singleton._data.items() if entry.torch_dispatch_rules._data]
    assert "torch_tp::all_reduce" in with_rules, with_rules  # the registry is the one torch_tp writes to
    assert all(name.startswith("torch_tp::") for name in with_rules), with_rules


# ---------------------------------------------------------------- nn.Module and optimizer helpers


def test_incompatible_keys():
    result = nn.Linear(2, 2).load_state_dict(nn.Linear(2, 2).state_dict())
    assert isinstance(result, private.IncompatibleKeys)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])


def test_global_backward_hooks():
    # The dicts the public registration functions fill, and empty again once their handles are removed.
    for register, hooks in ((torch.nn.modules.module.register_module_full_backward_hook, private.global_backward_hooks),
                            (torch.nn.modules.module.register_module_full_backward_pre_hook,
                             private.global_backward_pre_hooks)):
        assert not hooks
        handle = register(lambda *args: None)
        assert len(hooks) == 1
        handle.remove()
        assert not hooks


def test_legacy_get_string():
    with pytest.warns(UserWarning, match="deprecated"):
        assert private.legacy_get_string(None, False) == "none"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert private.legacy_get_string(False, None) == "sum"
        assert private.legacy_get_string(True, True) == "mean"


def test_foreach_helpers():
    a, b, c = torch.ones(2), torch.ones(3), torch.ones(2, dtype=torch.float64)
    grouped = private.group_tensors_by_device_and_dtype([[a, c, b]])
    cpu = torch.device("cpu")
    assert set(grouped) == {(cpu, torch.float32), (cpu, torch.float64)}
    ([tensors], _) = grouped[(cpu, torch.float32)]
    assert tensors[0] is a and tensors[1] is b
    # What clip_grad_norm_'s foreach=None and foreach=True decide by.
    assert private.has_foreach_support([a, b], cpu) and private.device_has_foreach_support(cpu)
    assert not private.device_has_foreach_support(torch.device("meta"))


# ---------------------------------------------------------------- DistributedDataParallel's torch DDP parity


def test_get_device_index():
    assert private.get_device_index(3, True) == 3
    assert private.get_device_index(torch.device("cuda", 1), True) == 1
    assert private.get_device_index("cuda:2", True) == 2


def test_to_kwargs():
    t = torch.ones(2)
    inputs, kwargs = private.to_kwargs((t, 1), {"k": t}, torch.device("cpu"), False)
    assert len(inputs) == len(kwargs) == 1  # one device
    assert inputs[0][0] is t and inputs[0][1] == 1 and kwargs[0]["k"] is t  # already there: not copied


def test_cast_forward_inputs():
    f, i = torch.ones(2), torch.ones(2, dtype=torch.int64)
    args, kwargs = private.cast_forward_inputs(torch.float16, f, i, k=f)
    assert (args[0].dtype, args[1].dtype, kwargs["k"].dtype) == (torch.float16, torch.int64, torch.float16)
    args, kwargs = private.cast_forward_inputs(None, f, k=f)
    assert args[0] is f and kwargs["k"] is f


def test_tree_flatten():
    t1, t2 = torch.ones(1), torch.zeros(1)
    leaves, _ = private.tree_flatten({"a": [t1, (t2, 3)], "b": None})
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    assert len(tensors) == 2 and tensors[0] is t1 and tensors[1] is t2
    assert 3 in leaves


def test_tree_map_only():
    t1, t2 = torch.ones(1), torch.zeros(1)
    mapped = private.tree_map_only(torch.Tensor, lambda t: t + 1, ((t1, 3), {"k": t2}))
    assert torch.equal(mapped[0][0], torch.full((1,), 2.0)) and mapped[0][1] == 3
    assert torch.equal(mapped[1]["k"], torch.ones(1))


def test_disable_torch_function_subclass():
    """Inside, a subclass's __torch_function__ is not called and results keep their own type."""
    calls = []

    class Seen(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    x = torch.ones(2).as_subclass(Seen)
    with private.disable_torch_function_subclass():
        y = x + 1
        shape = x.shape
    assert not calls and shape == (2,) and torch.equal(y, torch.full((2,), 2.0))
    x + 1
    assert calls


def test_set_post_accumulate_grad_hooks():
    """The dict set whole is what AccumulateGrad calls, after .grad is updated, with the leaf."""
    seen = []
    leaf = torch.ones(2, requires_grad=True)
    private.set_post_accumulate_grad_hooks(leaf, {0: lambda t: seen.append(t.grad.clone())})
    (leaf * 3).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((2,), 3.0))
