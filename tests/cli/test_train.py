"""``attnkit train``: mistakes are one line before any training starts; a run prints its table and writes its report."""

from __future__ import annotations

import base64
import contextlib
import io
import subprocess
import sys

import pytest

from attnkit.cli import main


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if a task starts training."""
    from attnkit.apps import vit

    def refuse(**kwargs):
        raise AssertionError("training started before the arguments were checked")

    monkeypatch.setattr(vit, "run", refuse)


@pytest.mark.parametrize("argv, words", [
    (["train", "nosuch"], "argument task: invalid choice: 'nosuch'"),
    (["train", "vit", "--steps", "0"], "argument --steps: expected an integer from 1, got 0"),
    (["train", "vit", "--steps", "-5"], "argument --steps: expected an integer from 1, got -5"),
    (["train", "vit", "--steps", "many"], "argument --steps: expected an integer from 1, got 'many'"),
    (["train", "vit", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
])
def test_usage_mistakes_are_one_line(argv, words, capsys, no_training):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_an_unwritable_out_is_one_line_before_training(tmp_path, no_training):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    rc, out, err = run_cli("train", "vit", "--out", str(blocker / "sub"))
    assert rc == 2 and out == ""
    assert err.startswith("attnkit train: error: --out ") and "cannot create this folder" in err
    assert len(err.strip().splitlines()) == 1


def test_the_installed_command_answers_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "attnkit", "train", "vit", "--steps", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_run_prints_its_table_and_writes_checkpoint_pictures_and_report(tmp_path):
    out = tmp_path / "run"
    rc, stdout, stderr = run_cli("train", "vit", "--quick", "--steps", "3", "--out", str(out))
    assert rc == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].split() == ["Metric", "Value"] and any(line.startswith("ViT test accuracy") for line in lines)
    assert any(line.startswith("Seconds in all") for line in lines)
    assert str(out) in lines[-1] and "report.html" in lines[-1]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    page = (out / "report.html").read_text()
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 3
    for png in pngs:
        assert base64.b64encode(png.read_bytes()).decode("ascii") in page
    assert "<td>Training steps per model</td><td class=\"num\">3</td>" in page


@pytest.mark.parametrize("argv, words", [
    (["train", "vit", "--pairs", "dates"], "--pairs dates: task 'vit' cannot train on it (it has no --pairs)"),
    (["train", "graph", "--model", "rnn"], "--model rnn: task 'graph' cannot train it (it has no --model)"),
])
def test_an_option_the_task_does_not_take_is_one_line(argv, words, no_training):
    rc, out, err = run_cli(*argv)
    assert rc == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1, err


def test_translate_takes_its_pairs_from_the_command_line(tmp_path):
    rc, stdout, stderr = run_cli("train", "translate", "--pairs", "dates", "--quick", "--steps", "2",
                                 "--out", str(tmp_path))
    assert rc == 0, stderr
    assert any(line.split()[:1] == ["Pairs"] and line.split()[-1] == "dates" for line in stdout.splitlines())
    assert "attnkit train translate --pairs dates --quick" in (tmp_path / "report.html").read_text()
