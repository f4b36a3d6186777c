"""A self-contained HTML report: sections of text, tables and PNG pictures, in one file.

The applications (``attnkit train``) and the experiments (``attnkit lab``) gather what they
found here. Same safety rules as the viewer: every string is escaped, pictures are embedded as
``data:`` URIs (no file or network reference, works from ``file://``), text is made UTF-8-safe,
and the file is written whole or not at all.

A table cell shows what a reader expects, never a Python repr: numbers formatted (floats to 4
significant digits, integers with thousands separators), ``True``/``False`` as yes/no, a sequence
of numbers or words comma-separated, a mapping as a small key/value table, a mapping of mappings
or a sequence of mappings as a nested table, a sequence of sequences as a table of rows.

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
import numbers
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path

from .._io import atomic_write
from .._text import utf8_safe

_STYLE = """
body { font: 15px/1.5 system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2.2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .8rem 0; } th, td { border: 1px solid #ccc; padding: .25rem .6rem; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td table { margin: 0; font-size: .92em; } td table th, td table td { padding: .1rem .4rem; }
img { max-width: 100%; display: block; margin: .8rem 0; border: 1px solid #eee; }
.verdict { font-weight: 600; }
"""


@dataclass(frozen=True)
class Section:
    """One part of a report.

    Args:
        title: the heading.
        text: paragraphs, separated by blank lines (plain text; escaped).
        table: rows as mappings of column -> value; columns are the rows' keys, in first-seen
            order. A value may itself be a sequence or mapping (see the module docstring).
        images: PNG files to embed, in order.
    """

    title: str
    text: str = ""
    table: Sequence[Mapping[str, object]] = field(default_factory=tuple)
    images: Sequence[str | Path] = field(default_factory=tuple)


def label(key: object, labels: Mapping[object, str] | None = None) -> object:
    """What a report calls ``key`` (a metric's or figure's name in code): its entry in ``labels``;
    else a string key with its underscores as spaces and its first letter capitalised
    (``"final_loss"`` -> ``"Final loss"``); else the key itself (a number)."""
    if labels is not None and key in labels:
        return labels[key]
    if isinstance(key, str):
        words = key.replace("_", " ").strip()
        return words[:1].upper() + words[1:]
    return key


def _esc(value: object) -> str:
    return html.escape(utf8_safe(str(value)), quote=True)


def _number(value: object) -> str | None:
    """``value`` as a number reads, or None if it is not a plain number."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real):
        return f"{float(value):.4g}"
    return None


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, str | numbers.Real)


def _listed(value: object) -> list | None:
    """The items of a sequence, set or array (a set sorted where its items allow), or None for
    anything else (strings and bytes are not lists here)."""
    if isinstance(value, str | bytes | Mapping):
        return None
    if isinstance(value, Set):
        try:
            return sorted(value)
        except TypeError:
            return list(value)
    if isinstance(value, Sequence):
        return list(value)
    if callable(getattr(value, "tolist", None)):  # numpy arrays, tensors
        items = value.tolist()
        return items if isinstance(items, list) else None
    return None


def _cell(value: object) -> str:
    """One ``<td>``: numbers right-aligned, structures as nested tables or lists (never their repr)."""
    if isinstance(value, bool):
        return f"<td>{_number(value)}</td>"
    number = _number(value)
    if number is not None:
        return f'<td class="num">{number}</td>'
    if value is None:
        return "<td></td>"
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, Mapping):
        return f"<td>{_mapping(value)}</td>"
    items = _listed(value)
    if items is None:
        if not isinstance(value, str) and callable(getattr(value, "item", None)):  # a 0-d array or tensor
            return _cell(value.item())
        return f"<td>{_esc(value)}</td>"
    if items and all(isinstance(v, Mapping) for v in items):
        return f"<td>{_table(items)}</td>"
    if all(_scalar(v) for v in items):
        shown = ", ".join("" if v is None else _number(v) or _esc(v) for v in items)
        numeric = bool(items) and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in items)
        return f'<td class="num">{shown}</td>' if numeric else f"<td>{shown}</td>"
    rows = "".join("<tr>" + "".join(map(_cell, _listed(v) or [v])) + "</tr>" for v in items)
    return f"<td><table><tbody>{rows}</tbody></table></td>"


def _mapping(value: Mapping) -> str:
    """A mapping as a table: of mappings, one row per key with the inner keys as columns; else
    one row per key, the key beside its value."""
    if not value:
        return ""
    if all(isinstance(v, Mapping) for v in value.values()):
        cols = list(dict.fromkeys(c for v in value.values() for c in v))
        head = "<th></th>" + "".join(f"<th>{_esc(c)}</th>" for c in cols)
        body = "".join(f'<tr><th scope="row">{_esc(k)}</th>' + "".join(_cell(v.get(c)) for c in cols) + "</tr>"
                       for k, v in value.items())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    body = "".join(f'<tr><th scope="row">{_esc(k)}</th>{_cell(v)}</tr>' for k, v in value.items())
    return f"<table><tbody>{body}</tbody></table>"


def _table(rows: Sequence[Mapping[str, object]]) -> str:
    if not rows:
        return ""
    cols = list(dict.fromkeys(c for row in rows for c in row))
    head = "".join(f"<th>{_esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(_cell(row.get(c)) for c in cols) + "</tr>" for row in rows)
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
        if isinstance(s.table, Mapping | str) or not all(isinstance(row, Mapping) for row in s.table):
            raise TypeError(f"Section {s.title!r}: table must be a sequence of mappings (one per row), got "
                            f"{type(s.table).__name__}" + ("" if isinstance(s.table, Mapping | str) else " holding "
                            + ", ".join(sorted({type(r).__name__ for r in s.table if not isinstance(r, Mapping)}))))
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
