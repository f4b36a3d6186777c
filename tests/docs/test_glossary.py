"""The Chinese-English glossary (``docs/tutorials/glossary.md``): the terms the articles use are there,
each linked to its attnkit name, and every attnkit name it gives exists."""

from __future__ import annotations

import importlib
import re

from tests.support.markdown_blocks import ROOT

GLOSSARY = ROOT / "docs" / "tutorials" / "glossary.md"


def rows() -> dict[str, list[str]]:
    """The table rows by their Chinese term: ``[English, what it means, in attnkit]``."""
    found = {}
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] not in ("中文", "---"):
            found[cells[0]] = cells[1:]
    return found


def test_the_articles_window_and_linearised_attention_are_there_with_their_attnkit_names():
    table = rows()
    english, meaning, where = table["截断自注意力"]
    assert english == "truncated self-attention" and "window" in meaning
    assert "`window=`" in where and "masks.sliding_window" in where
    english, meaning, where = table["线性化注意力"]
    assert english == "linearised attention" and "φ(Q) (φ(K)ᵀ V)" in meaning
    assert "approx.linear_attention" in where and "(../api/approx.md)" in where


def test_attention_score_says_the_articles_use_it_before_and_after_the_softmax():
    _, meaning, where = rows()["注意力分数"]
    assert "loosely" in meaning and "before the softmax" in meaning and "weights after it" in meaning
    assert "return_weights=True" in where


def test_every_attnkit_name_the_glossary_gives_exists():
    """``masks.sliding_window``, ``approx.linear_attention``, ...: each dotted name in the last column
    whose first part is an attnkit module is an attribute of that module."""
    checked = 0
    for term, (_, _, where) in rows().items():
        for name in re.findall(r"`([a-z_]+)\.(\w+)", where):
            try:
                module = importlib.import_module(f"attnkit.{name[0]}")
            except ModuleNotFoundError:
                continue
            assert hasattr(module, name[1]), f"{term}: attnkit.{name[0]} has no {name[1]}"
            checked += 1
    assert checked >= 20
