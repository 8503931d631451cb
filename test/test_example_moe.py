"""examples/train_llama.py --experts 4 --top-k 2: the mixture-of-experts model at other layouts, and its
checkpoints resumed across them (torchrun processes on gloo, test_example.py's small model).

1. Six steps of the same training at 1 rank, TP 2 (ExpertsTensorParallel), FSDP2 2 x EP 2
   (ExpertParallel; the experts' FSDP2 group has one rank), FSDP2 4 x EP 2 (the experts data
   parallel over 2 ranks) and FSDP2 2 x EP 2 x TP 2 (ExpertTensorParallel on the (ep, tp) mesh)
   give the 1-rank run's losses and gradient norms (--log-grad-norm: the whole model's and the
   experts' alone, before each step).
2. A run at FSDP2 2 x EP 2 stopped after 3 of 6 steps resumes from its DCP checkpoint at TP 2 (no
   EP), at 1 rank and at FSDP2 2 x EP 2 x TP 2, and must reach the uninterrupted run's losses.
3. Unsupported combinations are refused before any process group, naming the options.

Tolerance: test_example.py's LOSS_RTOL = 1e-5 relative, for the losses and for the gradient
norms. The layouts sum the same float32 products in other orders (sharded GEMMs, the tokens of
each expert gathered from other ranks, reductions over ranks), which moves a loss or a norm by
~1e-7 relative per step (the gradient norms measured ~1e-8 apart). The losses alone cannot catch
a wrong gradient scale: AdamW's update is invariant to it. The experts' gradient norm does:
expert-parallel experts whose gradients FSDP2 divides by dp / ep instead of dp (its default), or
by dp twice (torch 2.15's FSDP2 over a one-rank group with a sum reduction forced), are off by a
factor of 2 here (both measured).
"""

import importlib.util
import json
import os
import shutil

import pytest

from test_example import EXAMPLE, LOSS_RTOL, _assert_losses_close, _train

MOE = ["--experts", "4", "--top-k", "2", "--log-grad-norm"]
assert LOSS_RTOL == 1e-5  # the tolerance of the docstring, for the gradient norms too
LAYOUTS = [  # (name, ranks, options)
    ("tp2", 2, ()),
    ("fsdp2_ep2", 2, ("--dp", "2", "--ep", "2")),
    ("fsdp4_ep2", 4, ("--dp", "4", "--ep", "2")),
    ("fsdp2_ep2_tp2", 4, ("--dp", "2", "--ep", "2")),
]


def _metrics(out_dir, nproc, *extra):
    """One torchrun job of the example with the MoE model (test_example's launch); its metrics.json."""
    _train(out_dir, nproc, *MOE, *extra)
    with open(os.path.join(out_dir, "metrics.json")) as f:
        return json.load(f)


def test_moe_layouts_and_resume(tmp_path):
    single = _metrics(tmp_path / "single", 1)
    assert single["experts"] == 4 and single["top_k"] == 2
    assert len(single["losses"]) == 6 and single["losses"][-1] < single["losses"][0], single["losses"]
    for name, nproc, extra in LAYOUTS:
        got = _metrics(tmp_path / name, nproc, *extra)
        assert (got["dp"], got["ep"], got["tp"]) == {"tp2": (1, 1, 2), "fsdp2_ep2": (2, 2, 1),
                                                    "fsdp4_ep2": (4, 2, 1), "fsdp2_ep2_tp2": (2, 2, 2)}[name]
        for key in ("losses", "grad_norms", "expert_grad_norms"):
            _assert_losses_close(got[key], single[key], f"{name} {key} against 1 rank")

    stopped = _metrics(tmp_path / "stopped", 2, "--dp", "2", "--ep", "2", "--stop-after", "3")
    _assert_losses_close(stopped["losses"], single["losses"][:3], "fsdp2_ep2 stopped after 3 steps")
    for name, nproc, extra in [("tp2", 2, ()), ("single", 1, ()), ("fsdp2_ep2_tp2", 4, ("--dp", "2", "--ep", "2"))]:
        out = tmp_path / f"resumed_{name}"
        shutil.copytree(tmp_path / "stopped", out)
        resumed = _metrics(out, nproc, "--resume", *extra)
        _assert_losses_close(resumed["losses"], single["losses"], f"resumed at {name} from fsdp2_ep2")
        _assert_losses_close(resumed["grad_norms"], single["grad_norms"][3:], f"resumed at {name}: grad norms")


def test_unsupported_moe_options_are_refused(capsys):
    """The example's own parser (parse_args, what its command line runs first) exits with each error."""
    spec = importlib.util.spec_from_file_location("train_llama", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for extra, words in [
        (("--experts", "4", "--top-k", "5"), "--top-k 5 must be between 1 and --experts (4)"),
        (("--experts", "4", "--ep", "3", "--dp", "3"), "--ep 3 must divide --experts (4)"),
        (("--experts", "4", "--ep", "2", "--dp", "3"), "--ep 2 must divide --dp (3)"),
        (("--ep", "2", "--dp", "2"), "--ep 2 needs --experts"),
        (("--experts", "4", "--pp", "2"), "--experts with --pp"),
        (("--experts", "4", "--impl", "torch"), "--experts with --impl torch"),
        (("--experts", "4", "--save-hf", "hf"), "--experts with --save-hf"),
    ]:
        with pytest.raises(SystemExit) as exited:
            example.parse_args(list(extra))
        err = capsys.readouterr().err
        assert exited.value.code == 2 and words in err, (extra, err[-2000:])
