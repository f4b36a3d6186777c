"""``attnkit complexity``: FLOPs, score-matrix memory and parameters of attention, from shapes."""

from __future__ import annotations

from .command import LazyChoices


def _dtypes() -> list[str]:
    from ..analysis.complexity import DTYPE_BYTES

    return sorted(DTYPE_BYTES)


def _backends() -> list[str]:
    from ..analysis.complexity import MATERIALISING, TILED

    return list(MATERIALISING + TILED)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "complexity", help="FLOPs, score-matrix memory and parameter counts for given shapes",
        description="What self-attention costs for a sequence of N tokens, model width D and H heads: "
                    "FLOPs of the projections and of QK^T / PV (a multiply-add = 2), the n x n score "
                    "matrix and what the chosen backend keeps of it, and the Q/K/V/O parameter count, "
                    "with single-head versus multi-head compared (a widely copied multi-head count says "
                    "1,032,192 for d = 512, 8 heads, where the total is 1,048,576).",
        epilog="example: attnkit complexity --n 4096 --d 512 --heads 8 --layers 6 --dtype bfloat16 --backend sdpa")
    p.add_argument("--n", type=int, required=True, help="sequence length")
    p.add_argument("--d", type=int, required=True, help="model width (embed_dim); head width is d / heads")
    p.add_argument("--heads", type=int, default=1, help="number of heads (default 1)")
    p.add_argument("--layers", type=int, default=1, help="number of layers (default 1)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    # An explicit metavar: argparse would otherwise list the choices while the parser is built.
    p.add_argument("--dtype", default="float32", choices=LazyChoices(_dtypes), metavar="DTYPE",
                   help="element type: %(choices)s (default %(default)s)")
    p.add_argument("--backend", default="reference", choices=LazyChoices(_backends), metavar="BACKEND",
                   help="materialising (reference, naive, math) or tiled (sdpa, flash, blockwise); "
                        "default %(default)s")
    p.add_argument("--causal", action="store_true", help="causal mask (halves the QK^T and PV FLOPs)")
    p.add_argument("--bias", action="store_true", help="count projection biases")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..analysis import attention_cost, compare_heads
    from .command import UserError

    try:  # its ValueErrors are its checks of the sizes given
        cost = attention_cost(args.n, args.d, args.heads, layers=args.layers, batch=args.batch, dtype=args.dtype,
                              backend=args.backend, causal=args.causal, bias=args.bias)
    except ValueError as e:
        raise UserError(str(e)) from None
    rows = cost.rows()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print()
    print(f"single head versus {args.heads} heads (one layer):")
    for line in compare_heads(args.d, args.heads, n=args.n, bias=args.bias):
        print("  " + line)
    return 0
