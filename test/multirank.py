"""One reusable multi-rank harness for every pytest in torch_tp.

A :class:`RankPool` keeps ``world_size`` worker processes alive, each one a rank
of a torch.distributed group initialised over a FileStore, and runs functions on
all of them on request: ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank
and returns the per-rank results in rank order. Workers outlive a test, so the
cost of starting Python, importing torch and rendezvousing is paid once per
world size, not once per test.

Failures come back as :class:`RankError` with every failing rank's traceback.
A run that does not finish within its timeout (a hung collective, a rank
waiting on a peer that died) kills the pool and raises :class:`RankTimeout`
naming the ranks that did not answer; the next run starts a fresh pool. So a
broken test fails in seconds instead of blocking CI.

``fn`` must be picklable by reference: a module-level function of a test module.
"""

import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["RankError", "RankPool", "RankTimeout", "close_pools", "get_pool", "rank_context"]

# After one rank fails, how long the others get to finish or fail on their own
# before the pool is declared stuck (they may be blocked in a collective with
# the rank that failed).
FAILURE_GRACE_S = 10.0
# Start-up (spawn, import torch, rendezvous) on 2 busy cores with 4 ranks.
STARTUP_S = 120.0
# torch.distributed's own timeout inside the workers: shorter than any run's
# timeout would be pointless, longer only delays the harness' own verdict.
PG_TIMEOUT_S = 60.0


class RankError(AssertionError):
    """One or more ranks raised; the message holds each one's traceback."""


class RankTimeout(AssertionError):
    """A run did not finish in time; the pool was killed."""


def _worker_main(rank: int, world_size: int, backend: str, env: Dict[str, str], init_method: str,
                 compile_cache_dir: str, tasks: "mp.SimpleQueue", results: "mp.Queue") -> None:
    # torch and torch_tp are already imported (the forkserver preloads them,
    # see rank_context), so an environment variable that torch reads once at import
    # must be applied by hand: c10d's debug level is the one the tests use.
    os.environ.update(env)
    # torch.compile's caches (inductor reads this variable when it compiles,
    # not at import): see _compile_cache_dir.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir
    import torch
    import torch.distributed as dist

    import torch_tp  # noqa: F401  (registers the ops in the worker)

    dist.set_debug_level_from_env()
    torch.set_num_threads(1)  # 4 ranks on 2 cores: avoid oversubscription
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            results.put((rank, "ok", value))
        except BaseException:  # noqa: BLE001  (carry everything back, even KeyboardInterrupt)
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def rank_context() -> "mp.context.BaseContext":
    """Rank processes are forked from a forkserver that has imported torch and torch_tp
    once, so a pool starts in well under a second instead of paying a fresh
    interpreter's import of (CUDA) torch per rank. The forkserver is a clean
    single-threaded process, so forking from it is as safe as spawning: no
    OpenMP or c10d threads are inherited."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch_tp"])
    return ctx


def torchrun_command(log_dir: Any, *args: str) -> List[str]:
    """``python -m torch.distributed.run *args``, with torchrun's logs under ``log_dir`` (a
    test's tmp_path): without --log-dir every launch leaves a /tmp/torchelastic_* behind."""
    return [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(log_dir), *args]


class RankPool:
    """``world_size`` persistent ranks of one process group.

    Args:
        world_size: number of ranks.
        backend: the torch.distributed backend every rank initialises.
        env: environment variables set in every rank before it imports torch.
    """

    def __init__(self, world_size: int, backend: str = "gloo", env: Optional[Dict[str, str]] = None) -> None:
        self.world_size = world_size
        self.backend = backend
        self._tmpdir = tempfile.mkdtemp(prefix="torch_tp_pool_")
        init_method = "file://" + os.path.join(self._tmpdir, "store")
        ctx = rank_context()
        self._results = ctx.Queue()
        self._tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_worker_main, daemon=True, name=f"rank{rank}",
                        args=(rank, world_size, backend, dict(env or {}), init_method, _compile_cache_dir(),
                              self._tasks[rank], self._results))
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._ready = False
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> List[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self.alive:
            raise RuntimeError("RankPool.run on a pool that was killed")
        if not self._ready:
            self._collect(lambda: None, "ready", STARTUP_S)
            self._ready = True
        for task_queue in self._tasks:
            task_queue.put((fn, args, kwargs))
        return self._collect(fn, "ok", timeout)

    def _collect(self, fn: Callable[..., Any], expected: str, timeout: float) -> List[Any]:
        name = getattr(fn, "__qualname__", repr(fn)) if expected == "ok" else "start-up"
        values: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        started = time.monotonic()
        deadline = started + timeout
        while len(values) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, payload = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead and not errors:
                    errors.update({int(n[4:]): f"{n} exited with code {self._procs[int(n[4:])].exitcode}"
                                   for n in dead})
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            if status == expected:
                values[rank] = payload
            else:
                if not errors:
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                errors[rank] = payload
        missing = sorted(set(range(self.world_size)) - set(values) - set(errors))
        if missing:
            self.kill()
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            waited = time.monotonic() - started
            why = f"after rank(s) {sorted(errors)} failed" if errors else f"within {timeout:.0f} s"
            raise RankTimeout(
                f"{name} on {self.world_size} ranks: rank(s) {missing} did not finish {why} "
                f"(waited {waited:.0f} s; pool killed){detail}")
        if errors:
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{name} failed on rank(s) {sorted(errors)} of {self.world_size}:{detail}")
        return [values[r] for r in range(self.world_size)]

    def kill(self) -> None:
        """Terminate every rank at once (a stuck pool cannot be shut down politely)."""
        self.alive = False
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def close(self) -> None:
        """Shut the ranks down cleanly (destroy_process_group), killing any that hang."""
        if not self.alive:
            return
        for task_queue in self._tasks:
            task_queue.put(None)
        for proc in self._procs:
            proc.join(timeout=30)
        self.kill()


_POOLS: Dict[Tuple[int, str, Tuple[Tuple[str, str], ...]], RankPool] = {}
_COMPILE_CACHE: List[str] = []


def _compile_cache_dir() -> str:
    """torch.compile's cache directory for every pool: ``$TORCH_TP_TEST_COMPILE_CACHE`` (scripts/run_tests.sh
    gives its pytest runs one, remade with its build), else one of this process's, removed by
    :func:`close_pools`. A graph compiled at one world size or backend is reused at the others (the same ops,
    the same group names), but one compiled against an op schema from an earlier build is never replayed."""
    shared = os.environ.get("TORCH_TP_TEST_COMPILE_CACHE")
    if shared:
        return shared
    if not _COMPILE_CACHE:
        _COMPILE_CACHE.append(tempfile.mkdtemp(prefix="torch_tp_compile_cache_"))
    return _COMPILE_CACHE[0]


def get_pool(world_size: int, backend: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> RankPool:
    """The shared pool for ``(world_size, backend, env)``, started on first use or after a kill.

    ``backend`` defaults to ``$TORCH_TP_TEST_BACKEND`` or gloo, so the whole
    suite can run on another backend (``TORCH_TP_TEST_BACKEND=torch_tp``).
    """
    backend = backend or os.environ.get("TORCH_TP_TEST_BACKEND", "gloo")
    key = (world_size, backend, tuple(sorted((env or {}).items())))
    pool: Optional[RankPool] = _POOLS.get(key)
    if pool is None or not pool.alive:
        pool = _POOLS[key] = RankPool(world_size, backend, env)
    return pool


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
    for path in _COMPILE_CACHE:
        shutil.rmtree(path, ignore_errors=True)
    _COMPILE_CACHE.clear()
