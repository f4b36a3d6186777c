"""First use from several threads at once: the lazily built globals (the banded kernel's module and
self-check, the fused kernel's self-check) are made once, under a lock, and every thread gets them.

"First" must be real, so each run is a fresh Python process in which the module is not loaded yet
(its build is cached on disk by this session, so loading is fast). Threads wait behind a
``threading.Barrier`` and make their first call together, with the interpreter switching threads
every microsecond so that they interleave inside the load. Before the lock, two threads loading
the module together could get a module object whose functions were never added (pybind11 skips
initialising a second object made for a name it has already initialised): ``AttributeError: ...
has no attribute 'has_blas'`` in a third of such runs, and in some the process stayed broken.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from attnkit.backends import _band
from tests.support.racing import race

ROOT = Path(__file__).resolve().parents[2]
THREADS, RUNS = 8, 8


def _child(n: int) -> None:
    """In this fresh process: ``n`` threads make their first call together through the banded kernel,
    then one through the fused one, forward and backward; prints a JSON report of what went wrong."""
    import attnkit
    from attnkit.backends import _fused
    from tests.support import oracle

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 40, 8, generator=g, dtype=torch.float64) for _ in range(4))
    k, v = k[:, :2], v[:, :2]  # GQA: 4 query heads over 2 key/value heads
    backends = ("band", "fused_tiles")
    barrier = threading.Barrier(n)
    results, errors = [], []

    def first_calls(i):
        inputs = [[t.clone().requires_grad_() for t in (q, k, v)] for _ in backends]
        barrier.wait()
        for backend, (qi, ki, vi) in zip(backends, inputs, strict=True):
            try:
                out = attnkit.attention(qi, ki, vi, window=(3, 2), backend=backend)
                out.backward(dout)
                results.append((f"thread {i} ({backend})", (out.detach(), qi.grad, ki.grad, vi.grad)))
            except Exception as e:  # noqa: BLE001 - reported to the test
                errors.append(f"thread {i} ({backend}): {type(e).__name__}: {e}")

    sys.setswitchinterval(1e-6)  # threads switch inside the load, not only between calls
    threads = [threading.Thread(target=first_calls, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.setswitchinterval(0.005)
    try:  # and the process is not left broken for the calls that follow
        attnkit.attention(q, k, v, window=(3, 2), backend="band")
    except Exception as e:  # noqa: BLE001
        errors.append(f"a later call: {type(e).__name__}: {e}")

    # the output from the float64 oracle; the gradients from the reference backend (the oracle has none)
    want_out = oracle.attention(q, k, v, allowed=oracle.allowed_grid(2, 4, 40, 40, window=(3, 2)))[0]
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = attnkit.attention(qr, kr, vr, window=(3, 2), backend="reference")
    want = (want_out, *torch.autograd.grad(ref, (qr, kr, vr), dout))
    wrong = [f"{who}: {name} differs by {(a - b).abs().max().item():.3g}" for who, got in results
             for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
             if not torch.allclose(a, b, rtol=1e-9, atol=1e-10)]
    print(json.dumps({"errors": errors, "wrong": wrong, "band": _band.available(), "fused": _fused.available(),
                      "reason": _band.unavailable_reason()}))


@pytest.mark.slow
def test_threads_making_their_first_call_together_all_get_the_kernel():
    if not _band.available():  # (this process builds the kernel, so the children find it cached)
        pytest.skip(f"no compiled kernel: {_band.unavailable_reason()}")
    # the runs side by side: each is mostly imports, and their contention only adds to the interleaving
    procs = [subprocess.Popen([sys.executable, "-m", "tests.core.test_threads", str(THREADS)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(RUNS)]
    failures = []
    for run, proc in enumerate(procs):
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failures.append(f"run {run}: the process exited with {proc.returncode}: {err[-2000:]}")
            continue
        report = json.loads(out.strip().splitlines()[-1])
        failures += [f"run {run}: {line}" for line in report["errors"] + report["wrong"]]
        if not (report["band"] and report["fused"]):
            failures.append(f"run {run}: a kernel was refused afterwards ({report['reason']})")
    assert failures == [], "\n".join(failures)


if __name__ == "__main__":
    _child(int(sys.argv[1]))


# ---- the fold's cache (``_band._DILATED``): per intervals tensor, shared by threads ----------------------------

def _dilated(n: int = 24, d: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Intervals of every d-th key within +-3d, in the row's own class of positions mod d (foldable),
    fresh (version 0, as a plan's tables)."""
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    starts, ends = _band._intervals((((i - j).abs() <= 3 * d) & ((i - j) % d == 0))[None])
    return starts.clone(), ends.clone()


def test_a_tensor_given_a_dead_ones_id_never_gets_its_fold(monkeypatch):
    """The cache holds starts and ends weakly and compares them by identity, so intervals that took
    the id of dead ones (CPython reuses a freed object's memory), with the same versions, are looked
    at afresh. Every tensor is given one id here: the recycling at its worst."""
    monkeypatch.setattr(_band, "id", lambda obj: 1, raising=False)
    starts, ends = _dilated()
    assert _band._dilated(starts, ends, 1, 1, 24, 24)[0] == 2
    runs = starts + 2  # runs of two keys: nothing to fold (same shape, version 0 as ends)
    assert runs._version == ends._version
    assert _band._dilated(starts, runs, 1, 1, 24, 24) == (0, None)
    assert _band._dilated(starts, ends, 1, 1, 24, 24)[0] == 2
    plain = ends - 1  # another starts tensor: single keys, each row's own, one apart
    assert _band._dilated(plain, ends, 1, 1, 24, 24) == (0, None)


def test_threads_share_the_folds_cache():
    """Threads adding entries and sweeping dead ones at once: each keeps its last plans alive, so the
    cache stays full and every call that adds an entry sweeps it (before the lock: KeyError and
    "dictionary changed size during iteration" in every run)."""
    starts, ends = _dilated()

    def work(me, together):
        live = collections.deque(maxlen=10)  # plans in use, as a model's layers hold theirs
        for _ in range(300):
            live.append((starts.clone(), ends.clone()))
            d, rows = _band._dilated(*live[-1], 1, 1, 24, 24)
            assert d == 2 and rows[0].shape == (2, 12, 1), (d, rows)

    race(work, THREADS, 1e-6)
