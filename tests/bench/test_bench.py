"""The benchmark suites' shared tools (the suites themselves are programs, run by hand)."""

from __future__ import annotations

import ctypes
import itertools
import re
from pathlib import Path

import pytest
import torch

from attnkit.bench._util import interleaved_medians, median_time, progress


def test_progress_goes_to_stderr_with_the_elapsed_time(capsys):
    say = progress("blockwise")
    say("sliding window, forward")
    out, err = capsys.readouterr()
    assert out == ""
    assert re.fullmatch(r"attnkit bench blockwise: sliding window, forward \(\d+ s\)\n", err)


def test_timing_helpers_use_the_clock_they_are_given():
    ticks = itertools.count(0.0, 0.5)  # every reading 0.5 s after the last: each call lasts 0.5 s
    calls = []
    assert median_time(lambda: calls.append(1), repeat=3, warmup=2, clock=lambda: next(ticks)) == 0.5
    assert len(calls) == 5
    fake = itertools.count(0.0, 1.0)
    res = interleaved_medians({"a": lambda: None, "b": lambda: None}, repeat=3, warmup=1, clock=lambda: next(fake))
    assert res == {"a": 1.0, "b": 1.0}


def test_interleaved_rounds_can_alternate_their_order():
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "ab"}
    interleaved_medians(fns, repeat=3, warmup=0, alternate=True)
    assert order == ["a", "b", "b", "a", "a", "b"]
    order.clear()
    interleaved_medians(fns, repeat=2, warmup=0)
    assert order == ["a", "b", "a", "b"]


def test_the_window_budget_times_the_kernels_tiles_and_products():
    """`bench blockwise` splits the window forward's time into its products and the rest: its tiles
    must be the kernel's (each block's rows against the union of their windows, nothing more) and its
    products, made through ctypes, must be the products the kernel makes."""
    import torch

    from attnkit.bench import blockwise

    n, rows = 700, 64
    tiles = blockwise._window_tiles(n, rows)
    assert [t[0] for t in tiles] == list(range(0, n, rows)) and sum(t[1] for t in tiles) == n
    for i0, r, a, e in tiles:
        assert (a, e) == (max(0, i0 - blockwise.WINDOW), min(n, i0 + r + blockwise.WINDOW))
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not library.exists() or not hasattr(ctypes.CDLL(str(library)), "sgemm_"):
        pytest.skip("this torch has no sgemm_ in libtorch_cpu.so")
    torch.manual_seed(0)
    q, k, s = torch.randn(5, 64), torch.randn(9, 64), torch.empty(5, 9)
    v, out = torch.randn(9, 3), torch.empty(5, 3)
    products = blockwise._Products([(q, k, s, 5, 9, 64, True), (s, v, out, 5, 3, 9, False)])
    products()
    torch.testing.assert_close(s, q @ k.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, s @ v, rtol=1e-5, atol=1e-5)


def test_the_dtypes_suites_mistral_row_runs_both_implementations_and_compares_their_logits(monkeypatch):
    """`bench dtypes`' model row on a tiny sequence (its window shortened to fit): attnkit's calls are served
    by attnkit's kernel, the two implementations' logits agree within the bfloat16 row, and the table shows it."""
    pytest.importorskip("transformers")
    import torch

    from attnkit.bench import dtypes
    from tests.support.tolerances import TOLERANCES

    monkeypatch.setitem(dtypes.MISTRAL, "sliding_window", 16)
    said = []
    row = dtypes._mistral_prefill(48, 1, said.append)
    assert said[0] == "Mistral-style prefill, n = 48, bfloat16" and len(said) == 2
    label, n, dtype, served, ours, theirs, ratio, diff, scale = row
    assert (label, n, dtype, served) == ("Mistral-style, window 16", 48, "bfloat16", "band")
    assert ours > 0 and theirs > 0 and ratio == pytest.approx(theirs / ours)
    tol = TOLERANCES[torch.bfloat16]
    assert 0 < scale and diff <= tol["atol"] + tol["rtol"] * scale
    text = dtypes._model_text(row, 48, 1)
    assert "n = 48 tokens" in text and "| Mistral-style, window 16 | 48 | bfloat16 | band |" in text


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward and backward"])
def test_the_dtypes_suites_rows_time_attnkit_and_sdpa_in_every_dtype(backward):
    """`bench dtypes`' rows for one mask on a tiny size: every dtype on both sides, the pass named, attnkit's
    backend named, each time positive and the last column each dtype's time over attnkit's float32 time."""
    import torch

    from attnkit.backends import _band
    from attnkit.bench import dtypes

    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, 2, 64, 16, generator=g) for _ in range(4)]
    i = torch.arange(64)
    said = []
    products = {name: _band.half_products(dtypes.DTYPES[name]) for name in dtypes.HALF_PRODUCTS}
    rows = dtypes._case_rows("window +-8", {"window": (8, 8)}, {"attn_mask": (i[:, None] - i).abs() <= 8}, base,
                             backward, products, 1, 1, said.append)
    assert [r[1] for r in rows[:3]] == ["float32", "bfloat16", "float16"] and len(said) == len(rows)
    switched = [f"{name}, {'float32' if on else name} products" for name, on in products.items()
                if _band._products_ok.get(dtypes.DTYPES[name])]  # each half type timed the other way
    assert [r[1] for r in rows[3:]] == switched
    for label, _, pass_, backend, ours, theirs, ratio, _own in rows:
        assert label == "window +-8" and pass_ == ("forward and backward" if backward else "forward")
        assert backend == ("band" if _band.available() else backend) and ours > 0
        assert theirs == "-" or ratio == pytest.approx(theirs / ours)
    assert rows[0][-1] == 1 and all(r[-1] == pytest.approx(r[4] / rows[0][4]) for r in rows)


def test_a_bench_out_folder_others_may_write_into_is_refused_before_measuring(tmp_path, capsys):
    """`--out` is checked as every command's is, before minutes of measuring: a folder others may write into
    could have its table replaced, or a link planted under its name."""
    import os

    from attnkit.cli import main

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert main(["bench", "gpu", "--out", str(shared)]) != 0
    err = capsys.readouterr().err
    assert "--out" in err and "may write into" in err and len(err.strip().splitlines()) == 1, err
    assert list(shared.iterdir()) == []


def test_a_table_replaces_a_link_planted_under_its_name(tmp_path):
    from attnkit.bench._util import write_report

    target = tmp_path / "target.md"
    target.write_text("someone else's")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "core.md").symlink_to(target)
    text = write_report(tmp_path / "out", "core", "title", "body", "attnkit bench core")
    assert (tmp_path / "out" / "core.md").read_text() == text and target.read_text() == "someone else's"


def test_a_tables_header_names_the_threads_its_measurement_ran_on(tmp_path, monkeypatch):
    """A suite that measures on one thread in a process of more says one thread, not the process's count (which it
    restores before writing); one that measures on the process's threads names that count."""
    import platform

    from attnkit.bench import _util

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the process's count when the table is written
    one = _util.write_report(tmp_path, "t1", "title", "body", "cmd", threads=1)
    every = _util.write_report(tmp_path, "t2", "title", "body", "cmd")
    assert one.splitlines()[2].startswith(f"Measured on {platform.machine()}, 1 thread, torch {torch.__version__}, ")
    assert every.splitlines()[2].startswith(f"Measured on {platform.machine()}, 2 threads, torch ")


def test_the_dtypes_suites_tile_anchor_times_float32_and_each_half_type_whose_products_are_on():
    """The preamble's tile anchor: float32's product and the kernel's own product of each half type that is on
    (packing included), as GFLOP/s, after the sentence that names which float32 product the kernel runs, and the
    sentence that names which bfloat16 product ran."""
    from attnkit.backends import _band
    from attnkit.bench import dtypes

    on = _band.available() and bool(_band._products_ok.get(torch.bfloat16))
    tile = dtypes._tile_gflops({"bfloat16": on, "float16": False})
    assert set(tile) == ({"float32", "bfloat16"} if on else {"float32"})
    assert all(g > 0 for g in tile.values())
    text = dtypes._tile_text(tile)
    assert text.startswith(f"The kernel's float32 products: {_band.float32_products()}. "
                           "One q k^T tile of the kernel (64 x 1024 x 64), one thread: float32 ")
    assert ("its bfloat16 product here: " in text) == on
