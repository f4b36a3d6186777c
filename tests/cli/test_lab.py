"""``attnkit lab``: mistakes answered in one line before any work (and before torch), --list, a run."""

from __future__ import annotations

import pytest

from attnkit.cli import main
from attnkit.lab import EXPERIMENTS
from tests.support.cli_runner import run_fresh


def _run(*argv: str):
    return run_fresh(*argv)  # a fresh interpreter: did the command get as far as importing torch?


def test_unknown_names_are_one_line_before_any_work(tmp_path):
    out = tmp_path / "lab"
    proc = _run("lab", "scaling", "nosuch", "--out", str(out))
    assert "torch imported: False rc: 2" in proc.stdout, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "'nosuch'" in err and "scaling, projections" in err, err
    assert not out.exists()  # checked before --out is even created


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_unwritable_out_is_one_line_before_any_work(tmp_path, where):
    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    out = blocker if where == "a file" else blocker / "sub"
    proc = _run("lab", "--quick", "--out", str(out))
    assert "torch imported: False rc: 2" in proc.stdout, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and f"--out {out}" in err, err
    assert "scaling ..." not in proc.stdout  # no experiment started


def test_list_names_every_experiment_without_torch():
    proc = _run("lab", "--list")
    assert "torch imported: False rc: 0" in proc.stdout, proc.stdout + proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines()[:-1]]
    assert listed == list(EXPERIMENTS)


def test_a_run_prints_the_verdict_table_and_writes_the_report(tmp_path, capsys):
    assert main(["lab", "positions", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "positions  supported" in out
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "Run alone: attnkit lab positions" in page and "data:image/png;base64," in page
    assert (tmp_path / "lab_positions.png").stat().st_size > 0
