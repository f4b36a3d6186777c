"""Run a function on a local gloo process group, for tests, benchmarks and trying things on a laptop.

``run_local(fn, world, *args)`` spawns ``world`` processes on this machine, joins them into a gloo
group over the loopback interface (rendezvous through a temporary file), calls
``fn(rank, world, *args)`` in each and returns the results in rank order. A rank that raises
makes ``run_local`` raise at once with that rank's traceback (the others are terminated rather
than left waiting on it), and a timeout bounds everything, the group set-up included.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankError", "run_local"]


class RankError(RuntimeError):
    """A rank of :func:`run_local` failed, exited without a result, or ran out of time."""


def _worker(fn, rank, world, init_file, results, received, args, timeout, threads):
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        out = fn(rank, world, *args)
    except BaseException:  # noqa: B036 - report everything, including KeyboardInterrupt, to the parent
        # Report before tearing the group down: the other ranks then fail on a closed
        # connection, and the parent should hear the cause first.
        results.put((rank, False, traceback.format_exc()))
    else:
        results.put((rank, True, out))
        # Tensors travel as shared file descriptors that this process serves until the parent has
        # unpickled them: exiting at once made the parent's get() fail now and then.
        received.wait(timeout)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn: Callable, world: int, *args, timeout: float = 120.0, threads: int = 1) -> list:
    """Call ``fn(rank, world, *args)`` on ``world`` spawned processes in one gloo group.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        world: the number of processes.
        *args: passed to ``fn`` after ``rank`` and ``world``.
        timeout: seconds for the whole run; also the gloo timeout of each collective.
        threads: ``torch.set_num_threads`` in each process.

    Returns:
        ``[fn's result on rank 0, ..., on rank world-1]``.

    Raises:
        RankError: naming the first rank that failed, with its traceback; or the ranks still
            missing when ``timeout`` ran out.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    ctx = mp.get_context("spawn")
    results, received = ctx.Queue(), ctx.Event()
    done: dict[int, object] = {}
    with tempfile.TemporaryDirectory(prefix="attnkit-dist-") as tmp:
        init_file = Path(tmp) / "rendezvous"
        procs = [ctx.Process(target=_worker, args=(fn, r, world, str(init_file), results, received, args, timeout,
                                                    threads), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while len(done) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world)) - set(done))
                    raise RankError(f"ranks {missing} of {world} did not finish within {timeout:g} s")
                try:
                    rank, ok, payload = results.get(timeout=min(left, 0.5))
                except queue.Empty:
                    _check_alive(procs, done, results)
                    continue
                if not ok:
                    raise RankError(_failures(world, [(rank, payload)], results))
                done[rank] = payload
        finally:
            received.set()
            for p in procs:
                p.join(timeout=5.0 if len(done) == world else 0.0)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
    return [done[r] for r in range(world)]


def _check_alive(procs, done, results) -> None:
    """A process that died without a message (killed, segfault) is a failure, not a wait."""
    for rank, p in enumerate(procs):
        if rank not in done and p.exitcode is not None:
            time.sleep(0.2)  # its last message may still be in the pipe
            if results.empty():
                raise RankError(f"rank {rank} exited with code {p.exitcode} without reporting a result")


def _failures(world, failed, results, grace: float = 1.0) -> str:
    """The first failure, then any other rank's that arrives within ``grace`` seconds."""
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            rank, ok, payload = results.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if not ok:
            failed.append((rank, payload))
    return "\n".join(f"rank {r} of {world} failed:\n{p}" for r, p in failed)
