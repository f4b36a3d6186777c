"""`attnkit bench gpu` run on the CPU, small, before a GPU is ever lent to it.

A lent GPU comes for minutes: the program must not find its first bug there. Here every one of its
steps runs on the CPU at a tiny size, with Flex uncompiled (its eager maths: compiled Flex on the CPU has
no backward) and the models shrunk, and the table it writes is read back: every case, pass and
implementation has its row and nothing failed.
"""

from __future__ import annotations

import os

import pytest
import torch

from attnkit.bench import gpu
from tests.support.tolerances import TOLERANCES

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning",
                                        "ignore:_compile flag on create_block_mask:DeprecationWarning")


@pytest.fixture
def small(monkeypatch):
    """The bench shrunk to CPU size, Flex and transformers' Flex uncompiled."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)  # its eager maths has a CPU backward
    monkeypatch.setattr(torch, "compile", lambda fn=None, *args, **kwargs: fn if fn is not None else (lambda f: f))
    for name, value in {"H": 2, "D": 16, "WINDOW": 32, "LONGFORMER": 16, "GLOBALS": 4}.items():
        monkeypatch.setattr(gpu, name, value)
    monkeypatch.setattr(gpu, "MODEL", {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                                       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})


def _table(text: str, header: list[str]) -> list[list[str]]:
    lines = text.splitlines()
    at = lines.index("| " + " | ".join(header) + " |")
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.mark.slow
def test_every_step_runs_and_the_table_has_every_row(small, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "results"
    out.mkdir()
    planted = tmp_path / "elsewhere.md"
    planted.write_text("not the bench's")
    os.symlink(planted, out / "gpu.md")  # a link planted under the table's name is replaced, not written through
    text = gpu.measure([("kernels", 256), ("models", 256)], 1, torch.device("cpu"), out, "attnkit bench gpu")
    assert (out / "gpu.md").read_text() == text and not (out / "gpu.md").is_symlink()
    assert planted.read_text() == "not the bench's"
    assert "Not measured" not in text and "failed" not in text

    tol = TOLERANCES[torch.bfloat16]
    kernels = _table(text, gpu.KERNEL_HEADER)
    names = list(gpu._cases(256, torch.device("cpu")))
    assert [(r[0], r[2]) for r in kernels] == [(name, p) for name in names for p in ("fwd", "fwd+bwd")]
    for row in kernels:
        cells = dict(zip(gpu.KERNEL_HEADER, row, strict=True))
        assert cells["n"] == "256" and cells["attnkit backend"] == "band"
        for column in ("attnkit (ms)", "Flex + create_block_mask (ms)", "attnkit plan + BlockMask (ms)",
                       "create_block_mask, compiled (ms)"):
            assert float(cells[column]) > 0, (row, column)
        assert (cells["SDPA flash (ms)"] != "-") == (cells["mask"] == "causal")
        assert (cells["SDPA dense mask (ms)"] == "-") == ("ALiBi" in row[0] or "soft cap" in row[0])
        # unit-normal inputs: outputs are averages of values, within a few units
        assert float(cells["largest difference from Flex"]) <= tol["atol"] + tol["rtol"] * 4, row

    models = _table(text, gpu.MODEL_HEADER)
    assert [(r[0].split(",")[0], r[2]) for r in models] == [
        (m, impl) for m in ("Llama-style", "Mistral-style") for impl in gpu.IMPLEMENTATIONS]
    for model, n, impl, served, ms, speed, first, diff in models:
        assert n == "256" and float(ms) > 0 and float(first) >= 0 and speed.endswith("x")
        assert served == ("band" if impl == "attnkit" else "-")
        # the last hidden state is RMS-normalised: entries near 1, so the bfloat16 row's bound applies as it is
        assert float(diff) <= (0 if impl == "sdpa" else tol["atol"] + tol["rtol"] * 8), (model, impl, diff)


def test_the_masks_flex_sees_are_the_masks_attnkit_is_given(small):
    """Each case's Flex mask_mod, drawn dense, is the mask attnkit's own arguments make: the two sides of a
    row time the same attention."""
    import attnkit

    n = 256
    for name, (kw, mask_mod, _) in gpu._cases(n, torch.device("cpu")).items():
        plan = attnkit.mask_plan(kw.get("mask_mod"), q_len=n, is_causal=kw.get("is_causal", False),
                                 window=kw.get("window"))
        i = torch.arange(n)
        want = torch.broadcast_to(plan(0, 0, i[:, None], i[None, :]), (n, n))
        assert torch.equal(gpu._dense(mask_mod, n, torch.device("cpu")), want), name


def test_a_case_that_fails_gets_a_row_saying_so_and_the_run_goes_on(small, monkeypatch):
    def kernel_rows(name, n, *args):
        if name == "causal":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return [[name]]

    monkeypatch.setattr(gpu, "_kernel_rows", kernel_rows)
    said = []
    rows = gpu._kernels(256, 1, torch.device("cpu"), said.append, {})
    assert rows[0][:4] == ["causal", 256, "-", "failed: OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                                "2.00 GiB"]
    assert len(rows[0]) == len(gpu.KERNEL_HEADER)
    assert [r[0] for r in rows[1:]] == list(gpu._cases(256, torch.device("cpu")))[1:]
    assert said[1] == "  failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_steps_go_shortest_first_with_the_models_before_the_kernels_of_their_length():
    assert gpu.steps(quick=True) == [("models", gpu.QUICK_SIZE), ("kernels", gpu.QUICK_SIZE)]
    assert gpu.steps(quick=False) == [("models", 4096), ("kernels", 4096), ("kernels", 8192), ("models", 16384),
                                      ("kernels", 16384), ("kernels", 32768)]


def test_a_run_stopped_early_says_what_it_did_not_measure():
    body = gpu._body(torch.device("cpu"), [], [], [("kernels", 8192), ("models", 16384)])
    assert body.endswith("Not measured (the run stopped before them): kernels at n = 8192, models at n = 16384.")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_without_cuda_the_command_says_so_in_one_line(tmp_path, capsys):
    from attnkit.cli import main

    assert main(["bench", "gpu", "--quick", "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "no CUDA device" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "gpu.md").exists()
