"""A griffe extension: the reST habits of attnkit's docstrings, read as Markdown.

The docstrings are Google style, and two reST forms in them would render wrongly as Markdown:

* a literal block after ``::`` (the mask builders' pictures, "Plain PyTorch, for a reader::"):
  where the block is not indented below its paragraph, Markdown reads a picture's ``#`` rows as
  headings and ``>>>`` as quotes. Here it becomes a fenced code block, and ``text::`` becomes
  ``text:`` as reST prints it;
* roles such as ``:func:`attnkit.mask_plan``` become inline code.

Nothing in the code changes: the docstrings stay as ``help()`` shows them. Loaded by
``mkdocs.yml`` (``extensions:`` of the Python handler).
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|data|attr|exc|obj|const):`(~?)([^`]+)`")
LITERAL = re.compile(r"^(\s*)(.*?)::\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def markdown(text: str) -> str:
    """``text`` with its literal blocks fenced and its roles as inline code."""
    text = ROLE.sub(lambda m: f"`{m.group(2).split('.')[-1] if m.group(1) else m.group(2)}`", text)
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        m = LITERAL.match(lines[i])
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if not m or j == i + 1 or j == len(lines) or _indent(lines[j]) < len(m.group(1)):
            out.append(lines[i])
            i += 1
            continue
        indent, lead, inner = len(m.group(1)), m.group(2), _indent(lines[j])
        block, k = [], j
        while k < len(lines):
            if not lines[k].strip():  # a blank line ends the block unless the block goes on, indented
                nxt = k
                while nxt < len(lines) and not lines[nxt].strip():
                    nxt += 1
                if inner > indent and nxt < len(lines) and _indent(lines[nxt]) >= inner:
                    block += [""] * (nxt - k)
                    k = nxt
                    continue
                break
            if _indent(lines[k]) < inner:
                break
            block.append(lines[k][inner:])
            k += 1
        pad = " " * indent
        if lead.strip():
            out += [pad + (lead.rstrip() if lead.endswith(" ") else lead + ":"), ""]
        out += [pad + "```text", *(pad + b if b else "" for b in block), pad + "```"]
        i = k
    return "\n".join(out)


class RstDocstrings(griffe.Extension):
    """Rewrite each docstring with :func:`markdown` as griffe reads it."""

    def on_instance(self, *, node, obj, agent, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
