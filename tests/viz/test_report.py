"""The shared HTML report: everything escaped, pictures embedded, written whole."""

from __future__ import annotations

import ast
import re
from html.parser import HTMLParser

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


# ------------------------------------------------------------------ readable for people


_SNAKE = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")
_SUBSCRIPT = re.compile(r"[a-z]_[a-z0-9]{1,2}")  # d_k: a symbol with its subscript, not a variable name
_LOWER_WORD = re.compile(r"\W*([a-z]{2,})\b")


class _Cells(HTMLParser):
    """Collects (tag, text, first cell of its row, holds a table) for every h1, h2, th and td."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, str, bool, bool]] = []
        self.open: list[dict] = []
        self.rows: list[int] = []

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            for cell in self.open:
                cell["nested"] = True
        elif tag == "tr":
            self.rows.append(0)
        elif tag in ("h1", "h2", "th", "td"):
            first = tag in ("th", "td") and bool(self.rows) and self.rows[-1] == 0
            if tag in ("th", "td") and self.rows:
                self.rows[-1] += 1
            self.open.append({"tag": tag, "text": [], "first": first, "nested": False})

    def handle_endtag(self, tag):
        if tag == "tr" and self.rows:
            self.rows.pop()
        elif tag in ("h1", "h2", "th", "td") and self.open and self.open[-1]["tag"] == tag:
            cell = self.open.pop()
            self.found.append((tag, "".join(cell["text"]).strip(), cell["first"], cell["nested"]))

    def handle_data(self, data):
        if self.open:
            self.open[-1]["text"].append(data)


def label_problems(text: str) -> list[str]:
    """Why ``text``, shown as a heading or label, is not one for people: a snake_case identifier in
    it, or a first word in lower case (sentence case starts with a capital; a symbol such as n or
    d_k is fine)."""
    found = [f"{text!r} holds the identifier {m.group()!r}" for m in _SNAKE.finditer(text)
             if not _SUBSCRIPT.fullmatch(m.group())]
    first = _LOWER_WORD.match(text)
    if first and not _SUBSCRIPT.match(text, first.start(1)):
        found.append(f"{text!r} does not start in sentence case")
    return found


def _literal(text: str) -> bool:
    """Whether ``text`` is a Python list, tuple, dict or set printed whole (or the start of one)."""
    if "[{" in text or "{'" in text or "['" in text or "{\"" in text:
        return True
    if text[:1] not in ("[", "(", "{"):
        return False
    try:
        return isinstance(ast.literal_eval(text), list | tuple | dict | set)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False


def readability_problems(page: str, *, first_column: bool = False) -> list[str]:
    """What a reader of the report ``page`` meets that is not for people: h2 headings and table
    headers that are not labels (:func:`label_problems`), cells holding a Python structure's repr,
    and, with ``first_column``, first cells of rows (the labels of a figure or metric table) that
    hold an identifier or do not start in sentence case."""
    parser = _Cells()
    parser.feed(page)
    found = []
    for tag, text, first, nested in parser.found:
        if tag in ("h2", "th") and text:
            found += label_problems(text)
        if tag == "td" and not nested:
            if _literal(text):
                found.append(f"a cell shows a Python structure: {text[:80]!r}")
            elif first_column and first and text:
                found += label_problems(text)
    return found


def test_structures_in_cells_become_tables_and_lists_never_their_repr():
    import torch

    rows = [{"Name": "nested", "Value": [{"Layer": 0, "Kind": "previous"}, {"Layer": 1, "Kind": "broad"}]},
            {"Name": "numbers", "Value": [0.0, 1.5, 1000, 2.345678]},
            {"Name": "tuple", "Value": (3, 4)},
            {"Name": "words", "Value": ["red", "green"]},
            {"Name": "mapping", "Value": {"Attention": 1, "Recurrent": 512}},
            {"Name": "by n", "Value": {16: {"Attention": 12, "Recurrent": 50}, 32: {"Attention": 12, "Recurrent": 98}}},
            {"Name": "set", "Value": {(0, 4), (1, 2)}},
            {"Name": "rows", "Value": [[1, 2], [3, 4]]},
            {"Name": "tensor", "Value": torch.tensor([0.25, 0.5])},
            {"Name": "flag", "Value": True},
            {"Name": "missing", "Value": None}]
    page = report_html("T", [Section("Structures", table=rows)])
    assert readability_problems(page) == []
    assert "<th>Layer</th><th>Kind</th>" in page and "<td>previous</td>" in page  # a nested table, headed
    assert '<td class="num">0, 1.5, 1,000, 2.346</td>' in page and '<td class="num">3, 4</td>' in page
    assert "<td>red, green</td>" in page and '<td class="num">0.25, 0.5</td>' in page
    assert '<th scope="row">Recurrent</th><td class="num">512</td>' in page
    assert '<th scope="row">32</th><td class="num">12</td><td class="num">98</td>' in page
    assert "<tr><td class=\"num\">1</td><td class=\"num\">2</td></tr>" in page  # a sequence of sequences: rows
    # The set of pairs: sorted, one row per pair.
    assert ('<tr><td class="num">0</td><td class="num">4</td></tr>'
            '<tr><td class="num">1</td><td class="num">2</td></tr>') in page
    assert "<td>yes</td>" in page and "<td></td>" in page
    assert "tensor(" not in page and "True" not in page and "None" not in page


def test_text_inside_structures_is_escaped():
    evil = "<script>x</script>"
    page = report_html("T", [Section("S", table=[{"v": {evil: [evil, {evil: evil}]}, "w": [evil, 1]}])])
    assert "<script>" not in page and page.count("&lt;script&gt;") == 5


def test_a_table_that_is_not_rows_of_mappings_is_refused_naming_the_section():
    with pytest.raises(TypeError, match=r"Section 'S': table must be a sequence of mappings .* got dict"):
        report_html("t", [Section("S", table={"a": 1})])
    with pytest.raises(TypeError, match=r"table must be a sequence of mappings .* holding list"):
        report_html("t", [Section("S", table=[[1, 2]])])


@pytest.mark.parametrize(("page", "words"), [
    ("<table><tr><td>[{'a': 1}]</td></tr></table>", "Python structure"),
    ("<table><tr><td>{1024: 9.8}</td></tr></table>", "Python structure"),
    ("<table><tr><td>(0, 4)</td></tr></table>", "Python structure"),
    ("<h2>jacobian_trace_unscaled_4096</h2>", "identifier 'jacobian_trace_unscaled_4096'"),
    ("<table><tr><th>figure</th></tr></table>", "sentence case"),
    ("<table><tr><td>var_scaled_4096</td><td>1</td></tr></table>", "identifier"),
])
def test_the_readability_check_finds_what_it_looks_for(page, words):
    assert any(words in p for p in readability_problems(page, first_column=True))


def test_the_readability_check_passes_symbols_and_plain_text():
    page = ("<h2>Scores by d_k</h2><table><tr><th>n</th><th>Q = K shared</th></tr>"
            "<tr><td>Score variance, unscaled (d_k = 4096)</td><td>not run (quick)</td><td>0, 1, 0</td></tr></table>")
    assert readability_problems(page, first_column=True) == []


def app_report_problems(result) -> list[str]:
    """:func:`readability_problems` of an application's report: its evaluation table as
    ``Result.evaluation_rows`` gives it (the first column holds the metrics' labels), and the
    task's own sections."""
    evaluation = report_html(result.task, [Section("Evaluation", table=result.evaluation_rows())])
    return readability_problems(evaluation, first_column=True) + readability_problems(
        report_html(result.task, result.sections))
