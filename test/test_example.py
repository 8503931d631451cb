"""The main job, examples/train_llama.py, as a user launches it: torchrun processes on gloo.

A run stopped after 3 of 6 steps resumes from its DCP checkpoint at other
layouts (TP 4; 2 pipeline stages on 2 ranks under ZBVZeroBubble; TP 1 with
torch's own TP) and must reach the losses of the run that never stopped; so
must a run started at 2 pipeline stages x TP 2 (1F1B), stopped after 3 steps
and resumed at FSDP2 2 x TP 2 without pipelining. Tolerance: LOSS_RTOL = 1e-5
relative. The layouts sum the same float32 products in other orders (sharded
GEMMs, reductions over ranks, a mean of micro-batch means under pipelining),
which moves a loss by ~1e-7 relative per step; a
checkpoint that lost or misplaced a piece of a parameter or of the optimizer
state moves it by far more (a missing AdamW state alone changes the next
update by a factor of ~3).
"""

import json
import os
import shutil
import subprocess

from multirank import torchrun_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "train_llama.py")
SMALL = ["--dim", "32", "--layers", "2", "--heads", "4", "--seq", "16", "--batch", "4", "--steps", "6",
         "--sample", "0", "--ckpt-every", "0", "--backend", "gloo"]
LOSS_RTOL = 1e-5


def _train(out_dir, nproc, *extra):
    """One torchrun job of the example; its metrics.json's losses."""
    cmd = torchrun_command(f"{out_dir}_torchrun", "--standalone", f"--nproc-per-node={nproc}", EXAMPLE, *SMALL,
                           "--out-dir", str(out_dir), *extra)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    with open(os.path.join(out_dir, "metrics.json")) as f:
        return json.load(f)["losses"]


def _assert_losses_close(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} losses, want {len(want)}"
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"{what}: step {step} loss {a!r} vs {b!r}"


def test_resume_at_other_layouts(tmp_path):
    straight = _train(tmp_path / "straight", 2)
    stopped = _train(tmp_path / "stopped", 2, "--stop-after", "3")
    assert stopped == straight[:3]
    # From scratch on 2 pipeline stages x TP 2; its checkpoint resumes below without pipelining.
    pp_stopped = _train(tmp_path / "pp2_tp2_stopped", 4, "--pp", "2", "--pp-schedule", "1F1B", "--stop-after", "3")
    _assert_losses_close(pp_stopped, straight[:3], "pp 2 x tp 2 from scratch")
    for name, source, nproc, extra in [
        ("tp4", "stopped", 4, ()),
        ("pp2_zbv", "stopped", 2, ("--pp", "2", "--pp-schedule", "ZBVZeroBubble")),
        ("fsdp2x2_tp2_from_pp", "pp2_tp2_stopped", 4, ("--dp", "2")),
        ("tp1_torch", "stopped", 1, ("--impl", "torch")),
    ]:
        out = tmp_path / name
        shutil.copytree(tmp_path / source, out)
        resumed = _train(out, nproc, "--resume", *extra)
        _assert_losses_close(resumed, straight, f"resumed at {name} from {source}")


def _refused(tmp_path, *extra):
    """A 2-rank job of the example that must fail; its stderr."""
    cmd = torchrun_command(tmp_path / "torchrun", "--standalone", "--nproc-per-node=2", EXAMPLE, *SMALL,
                           "--out-dir", str(tmp_path), *extra)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    return done.stderr


def test_bad_dp_degree_is_refused(tmp_path):
    err = _refused(tmp_path, "--dp", "3")
    assert "--dp 3 must divide the world size (2)" in err, err[-2000:]


def test_bad_pipeline_is_refused(tmp_path):
    err = _refused(tmp_path, "--pp", "3")
    assert "--pp 3 must divide the world size (2)" in err, err[-2000:]
    # 2 ranks x 3 stages each: 6 stages for 2 layers + embedding + output.
    err = _refused(tmp_path, "--pp", "2", "--pp-schedule", "Interleaved1F1B", "--pp-stages-per-rank", "3")
    assert "makes 6 stages, more than the 2 layers + embedding + output" in err, err[-2000:]
