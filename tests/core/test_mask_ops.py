"""The mask analysis' native operators, ``attnkit::document_runs`` and ``attnkit::mask_runs``, called
directly through ``torch.ops.attnkit``: results against plain loops, every argument checked with an
error that names it (in the real operator and in the fake one torch.compile traces with), and a
memory guard that names the size before anything is allocated."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import attnkit
import attnkit.maskplan  # noqa: F401 - registers attnkit::mask_runs
import attnkit.masks  # noqa: F401 - registers attnkit::document_runs
from attnkit.memory import MAX_DENSE_BYTES_ENV
from tests.support.tolerances import close

document_runs = torch.ops.attnkit.document_runs
mask_runs = torch.ops.attnkit.mask_runs


def runs_of(row: list) -> list[tuple[int, int]]:
    """The runs ``[start, end)`` of True in a list of bools, by a loop."""
    out, start = [], None
    for j, x in enumerate([*row, False]):
        if x and start is None:
            start = j
        elif not x and start is not None:
            out.append((start, j))
            start = None
    return out


def padded(rows: list[list[tuple[int, int]]], width: int, fill: int) -> torch.Tensor:
    """``[len(rows), width, 2]``: each row's pairs, then ``(fill, fill)``."""
    return torch.tensor([[*r, *[(fill, fill)] * (width - len(r))] for r in rows], dtype=torch.int64).view(
        len(rows), width, 2)


# ---- attnkit::mask_runs ------------------------------------------------------------------------------


@given(p=st.integers(0, 3), r=st.integers(0, 4), lk=st.integers(0, 9), seed=st.integers(0, 2**16))
@example(p=1, r=2, lk=0, seed=0)  # no keys: the raw op failed in a reshape
@example(p=2, r=3, lk=7, seed=5)
def test_mask_runs_lists_each_rows_runs_of_true(p, r, lk, seed):
    allowed = torch.rand(p, r, lk, generator=torch.Generator().manual_seed(seed)) > 0.5
    starts, ends = mask_runs(allowed)
    rows = [runs_of(row) for row in allowed.reshape(p * r, lk).tolist()]
    k = max([1, *(len(x) for x in rows)])
    assert starts.dtype == ends.dtype == torch.int64 and starts.shape == ends.shape == (p, r, k)
    want = padded(rows, k, lk)
    assert torch.equal(torch.stack([starts, ends], -1).reshape(-1, k, 2), want)


def test_mask_runs_agrees_with_its_fake_under_opcheck():
    torch.library.opcheck(mask_runs.default, (torch.tensor([[[1, 0, 1, 1], [0, 0, 0, 0]]], dtype=torch.bool),))


def bad_allowed():
    return {
        "2-D": (torch.zeros(2, 3, dtype=torch.bool), ValueError,
                r"attnkit::mask_runs: allowed must be 3-D \[P, R, Lk\].*got shape \(2, 3\); pass allowed\[None\]"),
        "4-D": (torch.zeros(1, 2, 3, 4, dtype=torch.bool), ValueError, r"must be 3-D .* got shape \(1, 2, 3, 4\)"),
        "int64": (torch.zeros(1, 2, 3, dtype=torch.int64), TypeError,
                  "allowed must be a bool tensor .*got dtype torch.int64"),
        "float": (torch.ones(1, 2, 3), TypeError, "got dtype torch.float32"),
    }


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("case", list(bad_allowed()))
def test_mask_runs_names_a_bad_argument(case, fake):
    allowed, error, message = bad_allowed()[case]
    if fake:
        with FakeTensorMode() as mode, pytest.raises(error, match=message):
            mask_runs(mode.from_tensor(allowed))
    else:
        with pytest.raises(error, match=message):
            mask_runs(allowed)


def test_mask_runs_refuses_outputs_beyond_the_memory_limit_naming_their_size(monkeypatch):
    monkeypatch.setenv(MAX_DENSE_BYTES_ENV, "4096")
    alternating = (torch.arange(40) % 2 == 0).expand(1, 30, 40)  # 20 runs a row: [1, 30, 20] slots
    with pytest.raises(ValueError, match=r"attnkit::mask_runs would allocate 2 x int64 \[P, R, K\] = \(1, 30, 20\) "
                                         r".* = 28800 bytes \(28.1 KiB\), more than the limit of 4096 bytes "
                                         r"\(4.0 KiB\) \(set by ATTNKIT_MAX_DENSE_BYTES\); call it on fewer rows"):
        mask_runs(alternating)
    starts, _ = mask_runs(alternating[:, :2])  # 2 rows fit
    assert starts.shape == (1, 2, 20)


# ---- attnkit::document_runs ---------------------------------------------------------------------------


def document_runs_by_loops(q_ids: torch.Tensor, kv_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ``r`` of query ``i``: the ``r``-th run of one id in its row of keys when that id is the
    query's, else ``(Lk, Lk)``; as many slots as the most runs any row has."""
    lk = kv_ids.shape[1]
    kv_runs = []
    for row in kv_ids.tolist():
        runs = []
        for j, x in enumerate(row):
            if j and x == row[j - 1]:
                runs[-1][2] = j + 1
            else:
                runs.append([x, j, j + 1])
        kv_runs.append(runs)
    width = max([1, *(len(r) for r in kv_runs)])
    out = [[[(s, e) if x == qi else (lk, lk) for x, s, e in kv_runs[p]] for qi in q_row]
           for p, q_row in enumerate(q_ids.tolist())]
    pairs = torch.tensor([[[*c, *[(lk, lk)] * (width - len(c))] for c in row] for row in out],
                         dtype=torch.int64).view(len(out), q_ids.shape[1], width, 2)
    return pairs[..., 0], pairs[..., 1]


@given(p=st.integers(0, 3), lq=st.integers(0, 6), lk=st.integers(0, 9), docs=st.integers(1, 4),
       seed=st.integers(0, 2**16))
@example(p=0, lq=3, lk=4, docs=2, seed=0)  # no rows: the raw op failed on the max of nothing
@example(p=2, lq=5, lk=0, docs=2, seed=0)  # no keys
@example(p=2, lq=6, lk=9, docs=3, seed=7)
def test_document_runs_gives_each_query_the_runs_of_its_own_document(p, lq, lk, docs, seed):
    g = torch.Generator().manual_seed(seed)
    q_ids, kv_ids = torch.randint(0, docs, (p, lq), generator=g), torch.randint(0, docs, (p, lk), generator=g)
    starts, ends = document_runs(q_ids, kv_ids)
    want = document_runs_by_loops(q_ids, kv_ids)
    assert starts.dtype == torch.int64 and torch.equal(starts, want[0]) and torch.equal(ends, want[1])


def test_document_runs_agrees_with_its_fake_under_opcheck():
    torch.library.opcheck(document_runs.default, (torch.tensor([[0, 1, 1]]), torch.tensor([[0, 0, 1, 1, 0]])))


def bad_ids():
    ids = torch.zeros(2, 5, dtype=torch.int64)
    return {
        "1-D q_ids": ((ids[0], ids), ValueError, r"q_ids must be 2-D \[P, L\] .*got shape \(5,\)"),
        "3-D kv_ids": ((ids, ids[None]), ValueError, r"kv_ids must be 2-D \[P, L\] .*got shape \(1, 2, 5\)"),
        "P apart": ((ids, ids[:1]), ValueError, r"must have the same P, got shapes \(2, 5\) and \(1, 5\)"),
        "float ids": ((ids.double(), ids), TypeError, "q_ids must hold integer document ids, got dtype torch.float64"),
        "complex ids": ((ids, ids.to(torch.complex64)), TypeError, "kv_ids must hold integer document ids"),
    }


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("case", list(bad_ids()))
def test_document_runs_names_a_bad_argument(case, fake):
    (q_ids, kv_ids), error, message = bad_ids()[case]
    if fake:
        with FakeTensorMode() as mode, pytest.raises(error, match=message):
            document_runs(mode.from_tensor(q_ids), mode.from_tensor(kv_ids))
    else:
        with pytest.raises(error, match=message):
            document_runs(q_ids, kv_ids)


def test_document_runs_refuses_outputs_beyond_the_memory_limit_naming_their_size(monkeypatch):
    """20,000 queries against 20,000 keys each its own document would take 7.2 GB; it is refused
    before anything is allocated (the limit set here; by default the memory available)."""
    monkeypatch.setenv(MAX_DENSE_BYTES_ENV, str(1 << 30))
    every_key_its_own = torch.arange(20_000).view(1, -1)
    with pytest.raises(ValueError, match=r"attnkit::document_runs would allocate .*\[P, Lq, R\] = \(1, 20000, 20000\) "
                                         r".* = 7200000000 bytes \(6.7 GiB\), more than the limit of 1073741824 bytes"):
        document_runs(every_key_its_own, every_key_its_own)


def test_a_document_mask_over_the_memory_limit_or_of_float_ids_reads_its_predicate(monkeypatch):
    """Where the operator would refuse (or cannot take the ids), the Document mask gives no intervals
    and the plan is worked out from its predicate: the same mask, exactly."""
    ids = torch.tensor([0, 0, 1, 1, 1, 0, 2, 2, 0, 0])
    q = torch.randn(1, 2, 10, 4, dtype=torch.float64)
    want = attnkit.attention(q, q, q, mask_mod=attnkit.masks.document_mod(ids), backend="reference")
    for name, doc in (("float ids", attnkit.masks.document_mod(ids.double())),
                      ("over the limit", attnkit.masks.document_mod(ids))):
        if name == "over the limit":
            monkeypatch.setenv(MAX_DENSE_BYTES_ENV, "100")
        assert doc.intervals(1, 10, 10) is None, name
        p = attnkit.mask_plan(doc, q_len=10)
        assert p.starts is not None and p.derived_by != "its own intervals", name
        close(attnkit.attention(q, q, q, mask=p, backend="band"), want)
