"""Run a function on W processes joined by a torch.distributed process group (CPU, gloo).

Usage::

    from tests.dist_utils import run_ranks      # or: from dist_utils import run_ranks

    def _body(rank, world, a, b=0):             # module level, so that it can be pickled
        ...                                      # torch.distributed is initialised here
        return something_picklable

    results = run_ranks(_body, 4, a, b=1, timeout=60)   # results[r] is rank r's return value

Guarantees:

* Every rank runs ``fn(rank, world, *args, **kwargs)`` in a fresh process (start method
  ``spawn``) after ``torch.distributed.init_process_group`` on ``127.0.0.1`` with a free port;
  ``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS=1`` in the children.
* Return values come back to the parent pickled; ``results`` is ordered by rank.
* An exception in any rank raises :class:`RankError` in the parent, naming the rank and carrying
  its traceback; the other ranks are killed at once (they may be stuck in a collective).
* A rank that dies without reporting (signal, ``os._exit``) raises :class:`RankError` too.
* If not every rank has reported within ``timeout`` seconds, all children are killed and
  :class:`RankTimeout` (a ``TimeoutError``) is raised: a hang fails, it never blocks.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

__all__ = ["run_ranks", "free_port", "RankError", "RankTimeout"]


class RankError(RuntimeError):
    """A rank raised or died.

    ``rank`` is the first rank that reported a failure, ``details`` its traceback (or exit code);
    ``others`` maps further failing ranks (often follow-up errors of the first) to theirs.
    """

    def __init__(self, rank: int, details: str, others: Optional[Dict[int, str]] = None):
        self.rank = rank
        self.details = details
        self.others = dict(others or {})
        msg = f"rank {rank} failed:\n{details}"
        for r, d in sorted(self.others.items()):
            msg += f"\n--- rank {r} also failed (possibly as a consequence):\n{d}"
        super().__init__(msg)


class RankTimeout(TimeoutError):
    """Not every rank finished within the timeout."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}


@contextlib.contextmanager
def _environ(updates: Dict[str, str]):
    """Temporarily set environment variables (children started meanwhile inherit them)."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(fn, rank, world, port, backend, pg_timeout, args, kwargs, results) -> None:
    """Body of one child process: init the group, run ``fn``, report ``(rank, ok, payload)``."""
    dist = None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
        )
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world, *args, **kwargs)
        # Pickle here, so that an unpicklable result is reported as this rank's error instead of
        # failing silently in the queue's feeder thread.
        report = (rank, True, pickle.dumps(value))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        report = (rank, False, traceback.format_exc())
    # Report (and flush the report into the pipe) *before* leaving the process group: a failing
    # rank's peers only notice it when it tears down its connections, so the root cause reaches
    # the parent before the follow-up errors of the other ranks.
    results.put(report)
    results.close()
    results.join_thread()
    if dist is not None:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def _failure(results_q, procs, results, errors: Dict[int, str], grace: float = 1.0) -> RankError:
    """Build the error to raise once some rank failed (``errors``: reported failures so far).

    The other ranks get ``grace`` seconds to report too.  A rank that died without reporting is
    taken as the root cause (its peers' errors are usually consequences of its death); otherwise
    the first rank that reported an error is.
    """
    deadline = time.monotonic() + grace
    while len(results) + len(errors) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, payload = results_q.get(timeout=min(remaining, 0.1))
        except queue.Empty:
            continue
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
    for r, p in enumerate(procs):
        if r not in results and r not in errors and p.exitcode not in (None, 0):
            errors[r] = f"process exited with code {p.exitcode} without reporting"
    if not errors:  # cannot happen with the checks in run_ranks; be explicit anyway
        return RankError(-1, "a rank failed but no failure could be attributed")
    died = [r for r, d in errors.items() if d.startswith("process exited with code")]
    first = min(died) if died else next(iter(errors))
    others = {r: d for r, d in errors.items() if r != first}
    return RankError(first, errors[first], others)


def _kill(procs: List[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Optional[Dict[str, str]] = None,
    may_die: Optional[set] = None,
    **kwargs: Any,
) -> List[Any]:
    """Run ``fn(rank, world, *args, **kwargs)`` on ``world`` processes; return the results by rank.

    ``fn`` must be a module-level (picklable) function; ``args``/``kwargs`` and the return values
    must be picklable.  ``timeout`` bounds the whole run (start-up included) in seconds.  ``env``
    adds environment variables for the children.  Ranks in ``may_die`` may end by a signal (a test
    that kills one on purpose) without failing the run: their result is the exit code.
    """
    may_die = set(may_die or ())
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = free_port()
    # Collectives inside the children time out a little after the parent gives up; the parent
    # kills them anyway, this only matters for processes outliving a crashed parent.
    pg_timeout = max(30.0, float(timeout) + 30.0)
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world, port, backend, pg_timeout, args, kwargs, results_q),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout
    results: Dict[int, Any] = {}
    try:
        with _environ({**_CHILD_ENV, **(env or {})}):
            for p in procs:
                p.start()
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r in range(world) if r not in results]
                raise RankTimeout(
                    f"ranks {missing} of {world} did not finish within {timeout} s "
                    f"(running {getattr(fn, '__qualname__', fn)}); all children killed"
                )
            try:
                msg = results_q.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                # A child that exited with a non-zero code may have died without reporting.
                # Children flush their report into the pipe before exiting, so if a further read
                # finds nothing, the dead child never reported.
                for r in may_die:
                    if r not in results and procs[r].exitcode not in (None, 0):
                        results[r] = procs[r].exitcode
                dead = [r for r, p in enumerate(procs)
                        if r not in results and p.exitcode not in (None, 0)]
                if not dead:
                    continue
                try:
                    msg = results_q.get(timeout=1.0)
                except queue.Empty:
                    raise _failure(results_q, procs, results, {}) from None
            rank, ok, payload = msg
            if not ok:
                raise _failure(results_q, procs, results, {rank: payload})
            results[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _kill(procs)
        results_q.close()
        results_q.join_thread()
    return [results[r] for r in range(world)]


# ----------------------------------------------------------------------------------------------
# A rank killed while the group runs comet's ops
# ----------------------------------------------------------------------------------------------


def comet_segments() -> set:
    """comet's shared-memory segments that exist now (names in /dev/shm)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("comet-")}


def _ops_until_killed(rank, world, port, q, experts, tokens, stress, buffer_kwargs):
    """Run moe_layer0/1 in a loop; the last rank SIGKILLs itself after 0.5 s. Reports (rank,
    error text or "no error", seconds) through q."""
    import signal
    import threading

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["COMET_STRESS"] = str(stress)  # random delays keep every rank inside its calls
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    import comet

    buf = comet.Buffer(timeout=KILLED_PEER_TIMEOUT, **buffer_kwargs)
    E, H = experts, 64
    x, w0 = torch.randn(tokens, H), torch.randn(E // world, 64, H)
    ids = torch.randint(0, E, (tokens, 2))
    if rank == world - 1:  # die at a random point inside the op loop below
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf)
            comet.moe_layer1(y0.contiguous(), torch.randn(E // world, H, 64),
                             torch.rand(tokens, 2), layout, buffer=buf)
        q.put((rank, "no error", time.monotonic() - t0))
    except RuntimeError as e:
        q.put((rank, str(e), time.monotonic() - t0))
    q.close()
    q.join_thread()  # flush the report before skipping the normal exit path
    os._exit(0)  # skip destroy_process_group: a peer is gone


KILLED_PEER_TIMEOUT = 60.0  # the buffer timeout of the ranks in check_last_rank_killed
KILLED_PEER_NOTICE = 15.0   # how soon a survivor must notice the death


def check_last_rank_killed(world: int, *, experts: int, tokens: int, stress: int,
                           timeout: float, **buffer_kwargs) -> None:
    """The last of `world` ranks is SIGKILLed mid-call: every survivor must raise within
    KILLED_PEER_NOTICE seconds naming the dead rank ("rank W-1 (pid ...) has exited"), whichever
    rank noticed the death first (a survivor waiting on another survivor learns it from that
    one's fault), and no shared-memory segment may be left behind."""
    import signal

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ops_until_killed, daemon=True,
                         args=(r, world, port, q, experts, tokens, stress, buffer_kwargs))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=timeout) for _ in range(world - 1)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert procs[-1].exitcode == -signal.SIGKILL
    dead = f"rank {world - 1} (pid {procs[-1].pid}) has exited"
    for rank, msg, took in got:
        assert rank != world - 1
        assert dead in msg, f"rank {rank}'s error does not name the dead rank ({dead}): {msg}"
        # A dead pid is seen at once; the buffer's timeout is 4x longer, so a survivor that only
        # gave up after the timeout cannot pass for one that noticed the death.
        assert took < KILLED_PEER_NOTICE, f"rank {rank} needed {took:.1f} s to notice"
    leftovers = comet_segments()
    assert not leftovers, f"shared-memory segments left behind: {sorted(leftovers)}"
