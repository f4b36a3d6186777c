"""Output files are written whole and never through a link someone planted; an output folder must be
the user's own. ``attnkit lab`` is the command these tests drive (``train`` and ``viz`` already wrote
atomically)."""

from __future__ import annotations

import os
import stat

import pytest

from attnkit import lab
from attnkit._io import own_folder
from attnkit.cli import main


def _lab(capsys, *argv):
    rc = main(["lab", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err.strip()


def test_a_link_planted_in_the_out_folder_is_replaced_not_written_through(tmp_path, capsys):
    """Before: savefig(path) followed lab_positions.png to its target and overwrote it."""
    out, victim, page = tmp_path / "lab", tmp_path / "victim.txt", tmp_path / "page.txt"
    out.mkdir()
    victim.write_text("keep me")
    page.write_text("keep me too")
    (out / "lab_positions.png").symlink_to(victim)
    (out / "report.html").symlink_to(page)
    rc, stdout, err = _lab(capsys, "positions", "--quick", "--out", str(out))
    assert rc == 0, err
    assert victim.read_text() == "keep me" and page.read_text() == "keep me too"
    for name in ("lab_positions.png", "report.html"):
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 0
    assert (out / "lab_positions.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in out.iterdir()) == ["lab_positions.png", "report.html"]  # no temporary left


def test_a_dangling_out_link_says_what_it_is(tmp_path, capsys):
    """Before: 'cannot create this folder (File exists)'."""
    link = tmp_path / "lab"
    link.symlink_to(tmp_path / "gone")
    rc, _, err = _lab(capsys, "--out", str(link))
    assert rc == 2 and len(err.splitlines()) == 1
    assert f"--out {link} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in err


@pytest.mark.parametrize("mode, words", [
    (0o777, "is a folder every user may write into (mode 777)"),
    (0o1777, "is a folder every user may write into (mode 1777)"),  # like /tmp: sticky, still anyone's to fill
])
def test_an_out_folder_others_may_write_into_is_refused(tmp_path, capsys, mode, words):
    out = tmp_path / "lab"
    out.mkdir()
    out.chmod(mode)
    rc, stdout, err = _lab(capsys, "positions", "--quick", "--out", str(out))
    assert rc == 2 and f"--out {out} {words}" in err and "positions ..." not in stdout
    assert list(out.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no user ids on this system")
def test_an_out_folder_or_link_of_another_user_is_refused(tmp_path, capsys, monkeypatch):
    """The default ./attnkit-lab, run from /tmp, may have been made in advance by anyone."""
    out, link = tmp_path / "attnkit-lab", tmp_path / "link"
    out.mkdir(mode=0o755)
    link.symlink_to(out)
    someone_else = os.getuid() + 1
    monkeypatch.setattr(os, "getuid", lambda: someone_else)
    rc, _, err = _lab(capsys, "positions", "--out", str(out))
    assert rc == 2 and f"--out {out} is a folder owned by " in err and "not by you" in err
    rc, _, err = _lab(capsys, "positions", "--out", str(link))
    assert rc == 2 and f"--out {link} is a symbolic link (to {out}) owned by " in err
    with pytest.raises(ValueError, match="is a folder owned by"):  # the Python API checks it too
        lab.run_one("positions", quick=True, out=out)


def test_own_folder_creates_what_is_missing_never_writable_by_others(tmp_path):
    old = os.umask(0)
    try:
        made = own_folder(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert made.is_dir() and not made.stat().st_mode & stat.S_IWOTH
    assert own_folder(made) == made  # an existing folder of one's own is fine, again and again


def test_own_folder_accepts_a_folder_its_own_group_may_write(tmp_path):
    """umask 002 (user-private groups) makes folders group-writable; that group is the user's alone."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o775)
    assert own_folder(d) == d


def test_own_folder_names_what_is_in_the_way(tmp_path):
    f = tmp_path / "taken"
    f.write_text("a file")
    with pytest.raises(ValueError, match=rf"--out {f} is a file, not a folder"):
        own_folder(f, "--out")


@pytest.mark.parametrize("missing", ["new", "new/deeper"])
def test_an_out_path_through_a_missing_folder_and_dotdot_is_resolved_before_anything_is_created(tmp_path, capsys,
                                                                                                 missing):
    """``W/new/../existing`` names ``W/existing``: it is used as it is, and ``W/new`` is not created (the system
    cannot follow ``..`` out of a folder that does not exist: once, the parents were made, then "File exists")."""
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o755)
    up = ".." + "/.." * missing.count("/")  # back to tmp_path
    path = tmp_path / missing / up / "existing"
    assert own_folder(path, "--out") == existing.resolve()
    assert sorted(os.listdir(tmp_path)) == ["existing"]
    assert own_folder(tmp_path / missing / up / "fresh") == (tmp_path / "fresh").resolve()  # made where it names
    assert sorted(os.listdir(tmp_path)) == ["existing", "fresh"]
    (tmp_path / "sub" / "target").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "sub" / "target")
    # ".." after a link goes to its target's parent, as the system follows it
    assert own_folder(tmp_path / "link" / ".." / "beside") == (tmp_path / "sub" / "beside").resolve()
    assert (tmp_path / "sub" / "beside").is_dir() and not (tmp_path / "beside").exists()
