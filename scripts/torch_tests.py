"""Run torch's own tensor-parallel tests against torch_tp, beside the same tests on torch's TP.

    python scripts/torch_tests.py PYTORCH/test/distributed/tensor/parallel OUT [--run] [-k EXPR]

Takes torch's test files (test_tp_style.py, test_tp_examples.py, ... from a pytorch
checkout at the installed torch's release tag) and writes two copies of each:

  OUT/torch/     the files as torch runs them on a CPU-only machine
  OUT/torch_tp/  the same with torch_tp's names swapped in: every name imported from
                 torch.distributed.tensor.parallel[.style|.api|.loss] that torch_tp
                 exports comes from torch_tp.parallel, and so do the styles of the
                 Transformer test model (torch.testing's common_dtensor)

Both copies make the same changes to run on CPUs with gloo, and only these:
  - the gloo CPU test classes are instantiated (instantiate_device_type_tests drops
    ``except_for=["cpu"]``), and the transformer tests call ``_thaw_params`` through
    ``type(self)``, not through the generic class that instantiate_device_type_tests
    removes from the module;
  - ``@skip_unless_torch_gpu`` is dropped (those tests then run on the CPU);
  - assertions on CommDebugMode's counts are dropped: they count torch's functional
    collectives, and torch_tp's collectives are torch.ops.torch_tp.* ops. Every
    assertion on values, gradients, placements, shapes and errors stays.

With --run, pytest runs each file of both copies (pytest's -k EXPR if given) and
OUT/summary.txt gets one line per file and copy. torch_tp must be importable.
"""

import argparse
import ast
import pathlib
import re
import subprocess
import sys

TORCH_PARALLEL = "torch.distributed.tensor.parallel"
COMMON_DTENSOR = "torch.testing._internal.distributed._tensor.common_dtensor"
# What common_dtensor's Transformer.parallelize reads from torch.distributed.tensor.parallel.
COMMON_DTENSOR_NAMES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
                        "parallelize_module")


def _torch_tp_exports() -> set:
    import torch_tp.parallel

    return set(torch_tp.parallel.__all__)


def _replace_statements(text: str, nodes, replacement) -> str:
    """``text`` with each statement node replaced by ``replacement(node, indent)`` (a string)."""
    lines = text.splitlines(keepends=True)
    for node in sorted(nodes, key=lambda n: n.lineno, reverse=True):
        indent = " " * node.col_offset
        lines[node.lineno - 1:node.end_lineno] = [replacement(node, indent)]
    return "".join(lines)


def _drop_comm_counts(text: str) -> str:
    tree = ast.parse(text)
    counts = [node for node in ast.walk(tree)
              if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Attribute) and node.value.func.attr.startswith("assert")
              and re.search(r"get_comm_counts|get_total_counts", ast.get_source_segment(text, node))]
    return _replace_statements(text, counts, lambda node, indent: f"{indent}pass  # a CommDebugMode count\n")


def _for_cpu(text: str) -> str:
    kept = [line for line in text.splitlines(keepends=True)
            if line.strip() not in ('except_for=["cpu"],', "@skip_unless_torch_gpu")]
    text = _drop_comm_counts("".join(kept))
    return text.replace("DistTensorParallelExampleTest._thaw_params(", "type(self)._thaw_params(")


def _swap(text: str, exports: set) -> str:
    """Imports of torch's TP names that torch_tp exports, from torch_tp.parallel instead."""
    tree = ast.parse(text)
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0
               and node.module and (node.module == TORCH_PARALLEL or node.module.startswith(TORCH_PARALLEL + "."))]

    def replacement(node, indent):
        ours = [a for a in node.names if a.name in exports]
        theirs = [a for a in node.names if a.name not in exports]
        out = ""
        for module, aliases in ((node.module, theirs), ("torch_tp.parallel", ours)):
            if aliases:
                names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in aliases)
                out += f"{indent}from {module} import {names}\n"
        return out

    text = _replace_statements(text, imports, replacement)
    if "Transformer" in text and COMMON_DTENSOR in text:
        anchor = next(node for node in ast.parse(text).body if isinstance(node, ast.ClassDef))
        lines = text.splitlines(keepends=True)
        patch = (f"import {COMMON_DTENSOR} as _common_dtensor  # noqa: E402\n"
                 "import torch_tp.parallel as _torch_tp_parallel  # noqa: E402\n"
                 f"for _name in {COMMON_DTENSOR_NAMES!r}:\n"
                 "    setattr(_common_dtensor, _name, getattr(_torch_tp_parallel, _name))\n\n\n")
        first = anchor.lineno - 1 - len(anchor.decorator_list)
        text = "".join(lines[:first]) + patch + "".join(lines[first:])
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=pathlib.Path, help="torch's test/distributed/tensor/parallel")
    parser.add_argument("out", type=pathlib.Path, help="where the two copies go")
    parser.add_argument("--run", action="store_true", help="run pytest on every file of both copies")
    parser.add_argument("-k", dest="select", help="pytest's -k expression for --run")
    args = parser.parse_args()
    exports = _torch_tp_exports()
    files = sorted(args.tests.glob("test_*.py"))
    if not files:
        parser.error(f"no test_*.py in {args.tests}")
    for copy in ("torch", "torch_tp"):
        (args.out / copy).mkdir(parents=True, exist_ok=True)
    for path in files:
        text = _for_cpu(path.read_text())
        (args.out / "torch" / path.name).write_text(text)
        (args.out / "torch_tp" / path.name).write_text(_swap(text, exports))
    if not args.run:
        return 0
    summary, failed = [], False
    for path in files:
        for copy in ("torch", "torch_tp"):
            command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", path.name]
            if args.select:
                command += ["-k", args.select]
            log = args.out / copy / (path.stem + ".log")
            with open(log, "w") as out:
                rc = subprocess.call(command, cwd=args.out / copy, stdout=out, stderr=subprocess.STDOUT)
            last = [line for line in log.read_text(errors="replace").splitlines()
                    if re.match(r"=* *(\d+ \w+(, )?)+.* in [\d.]+s", line)]
            summary.append(f"{path.name:32} {copy:9} rc={rc}  {last[-1].strip('= ') if last else '(no summary)'}")
            print(summary[-1], flush=True)
            failed |= rc not in (0, 5)  # 5: no tests collected
    (args.out / "summary.txt").write_text("\n".join(summary) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
