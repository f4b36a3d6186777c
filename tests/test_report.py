"""The shared HTML report: everything escaped, pictures embedded, written whole."""

from __future__ import annotations

import re

import pytest

from attnkit.viz.report import Section, report_html, write_report

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16


def test_every_string_is_escaped_and_pictures_are_embedded(tmp_path):
    img = tmp_path / "a.png"
    img.write_bytes(PNG)
    evil = '<script>alert(1)</script>"\ud800'
    page = report_html(evil, [Section(evil, f"one\n\n{evil}", table=[{evil: evil, "n": 3, "x": 0.5}], images=[img])])
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "\ufffd" in page  # lone surrogate replaced, so the page encodes as UTF-8
    page.encode("utf-8")
    assert page.count("data:image/png;base64,") == 1
    assert not re.search(r'src="(?!data:)', page)  # no file or network references
    assert '<td class="num">3</td>' in page and '<td class="num">0.5</td>' in page


def test_non_png_pictures_and_bad_sections_are_refused(tmp_path):
    bad = tmp_path / "x.png"
    bad.write_text("<svg onload=alert(1)>")
    with pytest.raises(ValueError, match="PNG"):
        report_html("t", [Section("s", images=[bad])])
    with pytest.raises(TypeError, match="Section"):
        report_html("t", ["not a section"])
    with pytest.raises(TypeError, match="title"):
        report_html(3, [])


def test_write_report_replaces_the_file_whole(tmp_path):
    out = write_report(tmp_path / "r.html", "T", [Section("S", "text")])
    assert out.read_text(encoding="utf-8").startswith("<!doctype html>")
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]
