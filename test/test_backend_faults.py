"""The torch_tp backend under faults: dead and stuck peers, mismatched calls, leaks, two nodes.

These tests start their own processes (a fault kills or stalls a rank, which
the shared rank pools must never see). Each scenario runs ``world_size`` ranks
over a FileStore with a short group timeout (``TIMEOUT_S``) and checks, from
the outside, what every rank reported and how long it took:

* a rank killed with SIGKILL while inside an all_reduce or while its peer waits
  in recv, and a rank that never calls or never sends: every survivor raises an error naming the op and the missing rank
  within the timeout (plus ``SLACK_S`` for a busy 2-core machine), and exits; so does a
  rank whose peer skips the MoE token exchange's backward on gloo (its send/recv messages);
* ranks calling with different element counts, dtypes or collectives: every
  rank raises a "mismatch" error long before the timeout;
* /dev/shm holds no ``torch_tp_`` segment once the group is up, nor after a
  crash; destroy_process_group leaves no mapping and no extra thread behind;
* too little /dev/shm space is refused at init with a message naming it;
* two torchrun launches on this machine, each told it is its own node
  (``TORCH_TP_HOST_KEY``), form one 4-rank job whose collectives match gloo's.
"""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from multirank import rank_context, torchrun_command

TIMEOUT_S = 6.0
# Scheduling slack on 2 busy cores: the error must come within TIMEOUT_S + SLACK_S.
SLACK_S = 4.0
# Start-up of a rank (fork, rendezvous) on 2 busy cores.
STARTUP_S = 90.0
SMALL_BUFFER_ENV = {"TORCH_TP_SHM_BUFFER_BYTES": "65536"}
HERE = os.path.dirname(os.path.abspath(__file__))


def shm_segments():
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith("torch_tp_"))


def _rank_main(rank, world_size, init_file, scenario, env, events, backend):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    import torch_tp  # registers the backend

    torch.set_num_threads(1)
    events.put((rank, "started", None, 0.0))  # starts the queue's feeder thread before the count
    threads_before = len(os.listdir("/proc/self/task"))
    try:
        dist.init_process_group(backend, init_method="file://" + init_file, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=TIMEOUT_S))
    except Exception as e:  # noqa: BLE001  (reported to the test)
        events.put((rank, "init_error", str(e), 0.0))
        return
    x = torch.ones(1000)
    dist.all_reduce(x)  # every rank has finished init: mapped and unlinked every segment
    events.put((rank, "ready", shm_segments(), 0.0))
    start = time.monotonic()
    try:
        if scenario == "killed_mid_collective":
            # The last rank comes late, so the victim (rank 1) is inside the
            # all_reduce, waiting, when the test kills it.
            if rank == world_size - 1:
                time.sleep(2.0)
            events.put((rank, "entered", None, 0.0))
            start = time.monotonic()
            dist.all_reduce(torch.ones(100_000))
        elif scenario == "killed_mid_collective_subgroups":
            # As killed_mid_collective, with three more torch_tp
            # groups alive (each with its worker and sender threads) when the
            # survivors fail and exit.
            groups = [dist.new_group(list(range(world_size)), backend="torch_tp") for _ in range(3)]
            for group in groups:
                dist.all_reduce(torch.ones(10), group=group)
            if rank == world_size - 1:
                time.sleep(2.0)
            events.put((rank, "entered", None, 0.0))
            start = time.monotonic()
            dist.all_reduce(torch.ones(100_000), group=groups[1])
        elif scenario == "shape_mismatch":
            dist.all_reduce(torch.ones((2, 3) if rank == 0 else (3, 2)))
        elif scenario == "stuck_peer":
            if rank == 1:
                time.sleep(TIMEOUT_S + SLACK_S + 2.0)  # alive, but never calls
                events.put((rank, "ok", None, 0.0))
                return
            dist.all_reduce(torch.ones(100_000))
        elif scenario == "killed_in_recv":
            # Rank 1 sends part of what rank 0 waits for, then is killed.
            if rank == 1:
                dist.send(torch.ones(10), dst=0)
                events.put((rank, "entered", None, 0.0))
                time.sleep(STARTUP_S)
            else:
                got = torch.empty(10)
                dist.recv(got, src=1)
                events.put((rank, "entered", None, 0.0))
                start = time.monotonic()
                dist.recv(torch.empty(100_000), src=1)
        elif scenario == "stuck_in_recv":
            if rank == 1:
                time.sleep(TIMEOUT_S + SLACK_S + 2.0)  # alive, but never sends
                events.put((rank, "ok", None, 0.0))
                return
            dist.recv(torch.empty(100_000), src=1)
        elif scenario == "moe_backward_stuck_peer":
            # The token exchange's backward, whose rows go as gloo messages
            # (csrc/ops/comm_pieces.cpp), with rank 1 alive but never joining it.
            gen = torch.Generator().manual_seed(rank)
            hidden = torch.randn(64, 256, generator=gen, requires_grad=True)
            top_k_index = torch.randn(64, 4, generator=gen).topk(2, dim=-1).indices
            weights = torch.rand(64, 2, generator=gen, requires_grad=True)
            group = dist.group.WORLD
            rows, _, order, per_expert, recv_counts = torch_tp.ops.moe_token_dispatch(hidden, top_k_index, 4, group)
            out = torch_tp.ops.moe_token_combine(rows, weights, order, per_expert, recv_counts, group)
            if rank == 1:
                time.sleep(TIMEOUT_S + SLACK_S + 2.0)
                events.put((rank, "ok", None, 0.0))
                return
            start = time.monotonic()
            out.sum().backward()
        elif scenario == "numel_mismatch":
            dist.all_reduce(torch.ones(10 + 2 * rank))
        elif scenario == "dtype_mismatch":
            dist.all_reduce(torch.ones(10, dtype=torch.float32 if rank == 0 else torch.float64))
        elif scenario == "op_mismatch":
            if rank == 0:
                dist.broadcast(torch.ones(10), src=0)
            else:
                dist.all_reduce(torch.ones(10))
        elif scenario == "clean_shutdown":
            for numel in (10, 100_000):
                y = torch.ones(numel)
                dist.all_reduce(y)
                assert torch.equal(y, torch.full((numel,), float(world_size)))
            dist.destroy_process_group()
            maps = [line for line in open("/proc/self/maps") if "torch_tp_" in line]
            threads_after = len(os.listdir("/proc/self/task"))
            events.put((rank, "ok", {"maps": maps, "threads_before": threads_before,
                                     "threads_after": threads_after}, 0.0))
            return
        events.put((rank, "ok", None, time.monotonic() - start))
    except Exception as e:  # noqa: BLE001  (the error is what the test checks)
        events.put((rank, "error", str(e), time.monotonic() - start))
    dist.destroy_process_group()
    if scenario == "killed_mid_collective_subgroups":
        # After a failure too, destroying the groups joins every thread they started.
        events.put((rank, "destroyed", {"threads_before": threads_before,
                                        "threads_after": len(os.listdir("/proc/self/task"))}, 0.0))


# The jobs the running test started: its teardown kills any rank still running (a
# failed test's), so none lives on holding segments into the next test.
_started_jobs = []


class Job:
    """``world_size`` ranks of one scenario, each a process of its own reporting events;
    the FileStore's file goes in ``store_dir`` (the test's tmp_path)."""

    def __init__(self, world_size, scenario, store_dir, env=None, backend="torch_tp"):
        _started_jobs.append(self)
        ctx = rank_context()
        self.events = ctx.Queue()
        self.history = {}
        env = {**SMALL_BUFFER_ENV, **(env or {})}
        self.procs = [ctx.Process(target=_rank_main, daemon=True,
                                  args=(r, world_size, os.path.join(store_dir, "store"), scenario, env, self.events,
                                        backend))
                      for r in range(world_size)]
        for proc in self.procs:
            proc.start()

    def wait_for(self, kinds, count, timeout):
        """Until ``count`` ranks have reported one of ``kinds``: {rank: (kind, payload, seconds)},
        each rank's latest event of those kinds (earlier and other events stay in ``self.history``)."""
        deadline = time.monotonic() + timeout
        while True:
            found = {}
            for rank, history in self.history.items():
                matching = [event for event in history if event[0] in kinds]
                if matching:
                    found[rank] = matching[-1]
            if len(found) >= count:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"waited {timeout:.0f} s for {count} x {kinds}; got {self.history}")
            try:
                rank, kind, payload, seconds = self.events.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            self.history.setdefault(rank, []).append((kind, payload, seconds))

    def join(self, timeout):
        """Every process must exit on its own within ``timeout`` (no hang in teardown)."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.1))
        hung = [r for r, proc in enumerate(self.procs) if proc.is_alive()]
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        assert not hung, f"rank(s) {hung} did not exit within {timeout:.0f} s"

    def kill(self, rank):
        os.kill(self.procs[rank].pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _no_segments_left():
    assert shm_segments() == [], f"/dev/shm not empty before the test: {shm_segments()}"
    yield
    for job in _started_jobs:
        for proc in job.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    _started_jobs.clear()
    assert shm_segments() == [], f"/dev/shm holds torch_tp segments: {shm_segments()}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_killed_mid_collective(world_size, tmp_path):
    job = Job(world_size, "killed_mid_collective", tmp_path)
    ready = job.wait_for({"ready"}, world_size, STARTUP_S)
    for rank, (_, segments, _) in ready.items():
        assert segments == [], f"rank {rank}: segments still named in /dev/shm once the group is up: {segments}"
    job.wait_for({"entered"}, world_size - 1, STARTUP_S)  # all but the late rank are inside
    time.sleep(0.5)
    job.kill(1)
    survivors = [r for r in range(world_size) if r != 1]
    events = job.wait_for({"error", "ok"}, len(survivors), TIMEOUT_S + SLACK_S + 3.0)
    for rank in survivors:
        kind, message, seconds = events[rank]
        assert kind == "error", f"rank {rank} finished an all_reduce with a dead peer"
        assert "all_reduce" in message and "rank 1" in message, message
        assert seconds < TIMEOUT_S + SLACK_S, f"rank {rank} took {seconds:.1f} s to notice: {message}"
    job.join(30)


@pytest.mark.parametrize("run", range(3))
def test_survivor_exits_cleanly_after_peer_killed_with_subgroups(run, tmp_path):
    """With three sub-groups on the torch_tp backend and a rank SIGKILLed
    mid-all_reduce, every survivor raises the error, destroy_process_group joins
    every thread the four groups started, and the survivor exits with status 0.

    A survivor was once seen to die after the error with "terminate called without
    an active exception". That abort is not a torch_tp thread: it is a Python thread
    still inside a blocking c10d call when the interpreter exits (docs/architecture.md,
    "Exit"), and gloo aborts the same way."""
    world_size = 3
    job = Job(world_size, "killed_mid_collective_subgroups", tmp_path)
    job.wait_for({"ready"}, world_size, STARTUP_S)
    job.wait_for({"entered"}, world_size - 1, STARTUP_S)
    time.sleep(0.3 + 0.1 * run)  # vary where in the wait the kill lands
    job.kill(1)
    survivors = [0, 2]
    events = job.wait_for({"error", "ok"}, len(survivors), TIMEOUT_S + SLACK_S + 3.0)
    for rank in survivors:
        kind, message, _ = events[rank]
        assert kind == "error" and "all_reduce" in message and "rank 1" in message, message
    destroyed = job.wait_for({"destroyed"}, len(survivors), STARTUP_S)
    for rank in survivors:
        info = destroyed[rank][1]
        assert info["threads_after"] <= info["threads_before"], f"rank {rank}: threads left running: {info}"
    job.join(30)
    codes = {rank: job.procs[rank].exitcode for rank in survivors}
    assert all(code == 0 for code in codes.values()), f"survivors' exit codes (negative: the signal): {codes}"


def test_moe_exchange_backward_with_a_stuck_peer_on_gloo(tmp_path):
    """The token exchange as gloo messages (NOTE [all-to-all by pieces in messages]) with a peer that never joins
    the backward: an error naming the op within the group's timeout, no hang, and both ranks exit."""
    job = Job(2, "moe_backward_stuck_peer", tmp_path, {"TORCH_TP_GLOO_MESSAGE_BYTES": "4096"}, backend="gloo")
    job.wait_for({"ready"}, 2, STARTUP_S)
    kind, message, seconds = job.wait_for({"error", "ok"}, 2, TIMEOUT_S + SLACK_S + 3.0 + STARTUP_S)[0]
    assert kind == "error", "rank 0 finished the exchange's backward without its peer"
    assert "moe_token_combine" in message and "gloo" in message and "rank 1" in message, message
    assert seconds < TIMEOUT_S + SLACK_S, f"rank 0 took {seconds:.1f} s to notice: {message}"
    job.join(30)


def test_rank_killed_while_peer_in_recv(tmp_path):
    job = Job(2, "killed_in_recv", tmp_path)
    job.wait_for({"ready"}, 2, STARTUP_S)
    job.wait_for({"entered"}, 2, STARTUP_S)
    time.sleep(0.5)
    job.kill(1)
    kind, message, seconds = job.wait_for({"error", "ok"}, 1, TIMEOUT_S + SLACK_S + 3.0)[0]
    assert kind == "error", "rank 0 finished a recv from a dead peer"
    assert "recv" in message and "rank 1" in message, message
    assert seconds < TIMEOUT_S + SLACK_S, f"rank 0 took {seconds:.1f} s to notice: {message}"
    job.join(30)


@pytest.mark.parametrize("scenario, op", [("stuck_peer", "all_reduce"), ("stuck_in_recv", "recv")])
def test_stuck_peer_times_out(scenario, op, tmp_path):
    job = Job(2, scenario, tmp_path)
    job.wait_for({"ready"}, 2, STARTUP_S)
    events = job.wait_for({"error", "ok"}, 1, STARTUP_S)
    kind, message, seconds = events[0]
    assert kind == "error", f"rank 0 finished a {op} its peer never called"
    assert op in message and "rank 1" in message and "timed out" in message, message
    assert TIMEOUT_S * 0.5 < seconds < TIMEOUT_S + SLACK_S, f"error after {seconds:.1f} s: {message}"
    job.join(TIMEOUT_S + SLACK_S + 30)


@pytest.mark.parametrize("scenario, fragments", [
    ("numel_mismatch", ["10", "12"]),
    ("shape_mismatch", ["[2, 3]", "[3, 2]"]),
    ("dtype_mismatch", ["float", "double"]),
    ("op_mismatch", ["broadcast", "all_reduce"]),
])
def test_mismatch_across_ranks_is_an_error(scenario, fragments, tmp_path):
    job = Job(2, scenario, tmp_path)
    job.wait_for({"ready"}, 2, STARTUP_S)
    events = job.wait_for({"error", "ok"}, 2, STARTUP_S)
    for rank in range(2):
        kind, message, seconds = events[rank]
        assert kind == "error", f"rank {rank}: a mismatched call went through"
        assert "mismatch" in message.lower(), message
        for fragment in fragments:
            assert fragment in message.lower(), f"{fragment!r} not in {message}"
        # Found from the call headers, not by waiting out the timeout.
        assert seconds < TIMEOUT_S / 2, f"rank {rank} took {seconds:.1f} s: {message}"
    job.join(30)


def test_clean_shutdown_leaves_nothing(tmp_path):
    job = Job(2, "clean_shutdown", tmp_path)
    events = job.wait_for({"ok", "error"}, 2, STARTUP_S)
    for rank in range(2):
        kind, info, _ = events[rank]
        assert kind == "ok", info
        assert info["maps"] == [], f"rank {rank}: segments still mapped after destroy: {info['maps']}"
        assert info["threads_after"] <= info["threads_before"], f"rank {rank}: threads leaked: {info}"
    job.join(30)


def test_too_little_shm_is_refused(tmp_path):
    job = Job(2, "clean_shutdown", tmp_path, env={"TORCH_TP_SHM_BUFFER_BYTES": str(1 << 39)})  # 512 GiB per rank
    events = job.wait_for({"init_error", "ok"}, 2, STARTUP_S)
    for rank in range(2):
        kind, message, _ = events[rank]
        assert kind == "init_error", f"rank {rank} started with 512 GiB of shared memory per rank"
        assert "/dev/shm" in message, message
    job.join(30)


def test_bad_buffer_size_is_refused(tmp_path):
    job = Job(2, "clean_shutdown", tmp_path, env={"TORCH_TP_SHM_BUFFER_BYTES": "lots"})
    events = job.wait_for({"init_error", "ok"}, 2, STARTUP_S)
    for rank in range(2):
        kind, message, _ = events[rank]
        assert kind == "init_error" and "TORCH_TP_SHM_BUFFER_BYTES" in message and "lots" in message, message
    job.join(30)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes(tmp_path):
    """Two torchrun launches of 2 ranks each, told they are different nodes."""
    port = _free_port()
    launches = []
    for node in range(2):
        env = {**os.environ, **SMALL_BUFFER_ENV, "TORCH_TP_HOST_KEY": f"test-node-{node}", "OMP_NUM_THREADS": "1"}
        cmd = torchrun_command(tmp_path / "torchrun", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               os.path.join(HERE, "backend_two_node_job.py"), str(tmp_path))
        launches.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for launch in launches:
        try:
            out, _ = launch.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in launches:
                other.kill()
            raise
        outputs.append(out)
    for node, (launch, out) in enumerate(zip(launches, outputs)):
        assert launch.returncode == 0, f"node {node} failed:\n{out[-6000:]}"
    for rank in range(4):
        with open(tmp_path / f"rank{rank}.json") as f:
            report = json.load(f)
        assert report["failures"] == [], f"rank {rank}: {report['failures']}"
        assert report["checks"] > 10, report
