"""``attnkit bench SUITE``: run a benchmark suite and write its table."""

from __future__ import annotations

import importlib
from pathlib import Path

from .command import UserError, prepare_out


def add_parser(sub) -> None:
    from ..bench import SUITES

    p = sub.add_parser("bench", help="run a benchmark suite and write its markdown table",
                       description="Measure attnkit against anchors from the same run (PyTorch SDPA, "
                                   "the naive formula, this machine's matmul throughput).")
    p.add_argument("suite", nargs="?", default="core", choices=SUITES, help="which suite (default: core)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (a smoke run)")
    p.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="folder for the table (default: bench/results)")
    p.set_defaults(run=run)


def run(args) -> int:
    try:
        mod = importlib.import_module(f"attnkit.bench.{args.suite}")
    except ModuleNotFoundError as e:
        if e.name == f"attnkit.bench.{args.suite}":
            raise UserError(f"benchmark suite {args.suite!r} is not available in this version") from None
        raise UserError(f"benchmark suite {args.suite!r} needs {e.name}, which is not installed") from None
    prepare_out(args.out)  # before minutes of measuring: a folder of someone else's, or unwritable, fails here
    from ..bench._util import CannotMeasure  # imports torch: not before the arguments are checked

    try:
        table = mod.run(args.quick, args.out)
    except CannotMeasure as e:
        raise UserError(str(e)) from None
    print(table)
    print(f"table written to {args.out / (args.suite + '.md')}")
    return 0
