"""Benchmarks: programs that print ratios against anchors measured in the same run.

Each suite is a module here with ``run(quick: bool, out_dir: pathlib.Path) -> str`` that measures,
writes its markdown table to ``out_dir/<suite>.md`` and returns the table. ``attnkit bench SUITE``
runs one; ``python -m attnkit.bench SUITE`` does the same.
"""

__all__ = ["SUITES"]

SUITES = ["core", "blockwise", "mods", "models", "ring", "apps", "approx", "hf", "compile", "dtypes", "gpu"]
"""The suites ``attnkit bench`` offers, in the order its ``--help`` lists them: each a module here."""
