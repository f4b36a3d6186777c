"""The command line's reference, generated: ``<!-- cli-help -->`` in a page becomes the ``--help`` of
``attnkit`` and of each of its commands, as ``attnkit.cli.build_parsers`` makes them, so the page
cannot drift from the code. Importing the parser imports no torch."""

from __future__ import annotations

MARKER = "<!-- cli-help -->"


def reference() -> str:
    """Each command's ``--help`` under its own heading."""
    from attnkit.cli import build_parsers

    parser, commands = build_parsers()
    parser.prog = "attnkit"
    out = ["### `attnkit`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, sub in commands.items():
        out += [f"### `attnkit {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    """Fill the marker, where a page has one."""
    return markdown.replace(MARKER, reference()) if MARKER in markdown else markdown
