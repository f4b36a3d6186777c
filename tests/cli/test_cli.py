"""The command line: useful --help everywhere, one-line errors with a non-zero exit, no tracebacks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from attnkit.cli import COMMANDS, main
from attnkit.cli.command import UserError, build_parsers
from tests.support.cli_runner import run_fresh

AVAILABLE = [c for c in COMMANDS if c in build_parsers()[1]]


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "usage: attnkit" in text
    for cmd in AVAILABLE:
        assert cmd in text


@pytest.mark.parametrize("cmd", AVAILABLE)
def test_subcommand_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: attnkit {cmd}" in out and "options:" in out


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "usage: attnkit" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["bench", "nosuch"], "invalid choice: 'nosuch'"),
    (["bench", "core", "--repeat", "3"], "unrecognized arguments: --repeat 3"),
])
def test_usage_mistakes_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_console_script_has_no_traceback_for_user_mistakes():
    proc = subprocess.run([sys.executable, "-m", "attnkit", "bench", "nosuch"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_user_error_is_one_line_and_any_other_error_is_a_traceback(monkeypatch, capsys):
    """A ValueError of attnkit's own (a bug) is not turned into a user's mistake: it shows its traceback."""
    import attnkit.cli.complexity as complexity

    monkeypatch.setattr(complexity, "run", lambda args: (_ for _ in ()).throw(UserError("--n is too big\n for this")))
    assert main(["complexity", "--n", "8", "--d", "8"]) == 2
    assert capsys.readouterr().err == "attnkit complexity: error: --n is too big for this\n"
    for bug in (ValueError("a bug"), TypeError("another")):
        monkeypatch.setattr(complexity, "run", lambda args, bug=bug: (_ for _ in ()).throw(bug))
        with pytest.raises(type(bug), match=str(bug)):
            main(["complexity", "--n", "8", "--d", "8"])


def test_a_subcommand_mistake_points_to_that_subcommands_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "attnkit demo: error: unrecognized arguments: --bogus (see 'attnkit demo --help')"


@pytest.mark.parametrize("argv", [
    ["viz", "some text", "--layer", "-1"],
    ["viz", "some text", "--head", "x"],
    ["demo", "--bogus"],
    ["complexity", "--n", "8"],
    ["complexity", "--dtype", "float7"],
])
def test_argument_mistakes_are_answered_before_torch_is_imported(argv):
    proc = run_fresh(*argv)
    assert "torch imported: False rc: 2" in proc.stdout, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_layer_numbers_are_checked_while_parsing(capsys):
    with pytest.raises(SystemExit) as e:
        main(["viz", "some text", "--layer", "-1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --layer: expected an integer from 0" in err and "got -1" in err


def test_bench_core_prints_one_aligned_line_per_measurement(monkeypatch, tmp_path, capsys):
    import attnkit.bench.core as core

    monkeypatch.setattr(core, "matmul_gflops", lambda n: 100.0)
    monkeypatch.setattr(core, "interleaved_medians",
                        lambda fns, repeat, **_: {n: 3e-3 if n == "naive" else 1e-3 for n in fns})
    assert main(["bench", "core", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[" not in out.split("# ")[0], out  # no Python lists before the markdown report
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == " ".join(core.HEADER).split())
    rows = lines[header + 1:header + 5]
    assert [r.split()[:2] for r in rows] == [["256", "fwd"], ["256", "fwd+bwd"], ["512", "fwd"], ["512", "fwd+bwd"]]
    assert all(len(r) == len(lines[header]) for r in rows)  # each cell right-aligned under its column name
    assert rows[0].split()[2:7] == ["1.00", "1.00", "3.00", "1.000", "3.00"]


def test_no_user_facing_text_names_documents_users_do_not_have(capsys):
    """Help and output describe the claim or the mistake in words, never an internal document number."""
    texts = []
    for cmd in AVAILABLE:
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        texts.append(capsys.readouterr().out)
    assert main(["complexity", "--n", "512", "--d", "512", "--heads", "8"]) == 0
    texts.append(capsys.readouterr().out)
    for text in texts:
        text = re.sub(r"--seed\b|random seeds?\b", "", text)  # the RNG's seed is not a document
        assert not re.search(r"\bseeds?\b", text, re.I), text
