"""A self-contained HTML report: sections of text, tables and PNG pictures, in one file.

The applications (``attnkit train``) and the experiments (``attnkit lab``) gather what they
found here. Same safety rules as the viewer: every string is escaped, pictures are embedded as
``data:`` URIs (no file or network reference, works from ``file://``), text is made UTF-8-safe,
and the file is written whole or not at all.

Usage::

    from attnkit.viz.report import Section, write_report
    write_report("out/report.html", "ViT on digits", [
        Section("Accuracy", "Test accuracy after 300 steps.", table=[{"model": "ViT", "acc": 0.97}],
                images=["out/rollout.png"]),
    ])
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._io import atomic_write
from .._text import utf8_safe

_STYLE = """
body { font: 15px/1.5 system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2.2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .8rem 0; } th, td { border: 1px solid #ccc; padding: .25rem .6rem; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; display: block; margin: .8rem 0; border: 1px solid #eee; }
.verdict { font-weight: 600; }
"""


@dataclass(frozen=True)
class Section:
    """One part of a report.

    Args:
        title: the heading.
        text: paragraphs, separated by blank lines (plain text; escaped).
        table: rows as mappings of column -> value; columns are the first row's keys.
        images: PNG files to embed, in order.
    """

    title: str
    text: str = ""
    table: Sequence[Mapping[str, object]] = field(default_factory=tuple)
    images: Sequence[str | Path] = field(default_factory=tuple)


def _esc(value: object) -> str:
    return html.escape(utf8_safe(str(value)), quote=True)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f'<td class="num">{value:.4g}</td>'
    if isinstance(value, int) and not isinstance(value, bool):
        return f'<td class="num">{value:,}</td>'
    return f"<td>{_esc(value)}</td>"


def _table(rows: Sequence[Mapping[str, object]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    head = "".join(f"<th>{_esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(_cell(row.get(c, "")) for c in cols) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _image(path: str | Path) -> str:
    path = Path(path)
    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError(f"report images must be PNG files, got {path} (its first bytes are not a PNG signature)")
    return f'<img alt="{_esc(path.name)}" src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}">'


def report_html(title: str, sections: Sequence[Section]) -> str:
    """The page as a string (see the module docstring)."""
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    parts = [f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{_esc(title)}</title>",
             f"<style>{_STYLE}</style></head><body><h1>{_esc(title)}</h1>"]
    for s in sections:
        if not isinstance(s, Section):
            raise TypeError(f"sections must hold Section objects, got {type(s).__name__}")
        parts.append(f"<section><h2>{_esc(s.title)}</h2>")
        parts += [f"<p>{_esc(p.strip())}</p>" for p in s.text.split("\n\n") if p.strip()]
        parts.append(_table(s.table))
        parts += [_image(p) for p in s.images]
        parts.append("</section>")
    parts.append("</body></html>\n")
    return "".join(parts)


def write_report(path: str | Path, title: str, sections: Sequence[Section]) -> Path:
    """Write :func:`report_html` to ``path`` atomically; return the path."""
    page = report_html(title, sections).encode("utf-8")
    return atomic_write(path, lambda f: f.write(page))
