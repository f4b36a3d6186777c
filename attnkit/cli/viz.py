"""``attnkit viz TEXT``: any local BERT's attention on TEXT as heat maps and an offline HTML viewer."""

from __future__ import annotations

from pathlib import Path

from .command import index


def add_parser(sub) -> None:
    p = sub.add_parser(
        "viz", help="heat maps and an interactive HTML viewer of a BERT model's attention on TEXT",
        description="Run a local BERT-format model (config.json + model.safetensors + tokenizer; default: "
                    "the bundled MiniLM) on TEXT and write viewer.html (interactive, offline), heat maps "
                    "of the chosen layers/heads, the entropy per head and the attention rollout.")
    p.add_argument("text", help="the text to read (quote it)")
    p.add_argument("--model", type=Path, default=None, help="a local BERT model folder (default: bundled MiniLM)")
    p.add_argument("--layer", type=index, action="append", default=None,
                   help="layer to draw, from 0 (repeatable; default: every layer)")
    p.add_argument("--head", type=index, default=None,
                   help="draw only this head of each chosen layer (default: a grid of all heads)")
    p.add_argument("--out", type=Path, default=Path("attnkit-viz"), help="output folder (default: ./attnkit-viz/)")
    p.add_argument("--format", choices=("png", "svg"), default="png", help="heat map format (default: png)")
    p.add_argument("--terms", action="store_true",
                   help="keep each layer's queries and keys in the viewer: clicking a cell of its matrix then "
                        "shows that score's terms per head dimension")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..demos import real_model as rm

    att = rm.run(args.text, args.model, qk=args.terms,
                 before_run=lambda config: rm.check_outputs(config, args.out, layers=args.layer, head=args.head))
    rm.warn_unknown(att, "viz")
    n_layers, n_heads, n = att.shape
    print(f"{n} tokens, {n_layers} layers x {n_heads} heads" +
          (f" (the last {att.truncated} tokens were cut to fit the model)" if att.truncated else ""))
    written = rm.write_outputs(att, args.out, layers=args.layer, head=args.head, fmt=args.format, title="attnkit viz")
    rm.show_written(args.out, written)
    return 0
