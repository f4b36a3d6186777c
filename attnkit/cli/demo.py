"""``attnkit demo``: a real pretrained model's attention on a sentence where "bank" needs "river", printed and drawn.

The default sentence is the one a widely read scaled dot-product attention tutorial uses to motivate
attention: to tell which "bank" is meant, a reader looks at "river".
"""

from __future__ import annotations

import time
from pathlib import Path

SENTENCE = "The river bank was eroding."
#: How many heads are listed, and drawn in top_heads.png (the same ones).
TOP = 5
#: Longest echo of the text and of its tokens on one stdout line.
ECHO = 80


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="which heads of a real model link 'bank' to 'river'; writes a viewer and heat maps",
        description="Run the bundled MiniLM (all-MiniLM-L6-v2, a 6-layer BERT, through attnkit's own "
                    f"modules, offline) on \"{SENTENCE}\" or your --text, print which heads link the "
                    "--query word to the --key word and how strongly, and write an interactive HTML "
                    "viewer and PNG heat maps into --out.")
    p.add_argument("--text", default=SENTENCE, help=f"the text to read (default: {SENTENCE!r})")
    p.add_argument("--query", default="bank", help="the word whose attention is reported (default: bank)")
    p.add_argument("--key", default="river", help="the word it should attend to (default: river)")
    p.add_argument("--out", type=Path, default=Path("attnkit-demo"),
                   help="folder for viewer.html and the PNGs (default: ./attnkit-demo/)")
    p.add_argument("--model", type=Path, default=None,
                   help="a local BERT folder (config.json + model.safetensors) instead of the bundled MiniLM")
    p.add_argument("--top", type=int, default=TOP, help=f"how many heads to list and draw (default: {TOP})")
    p.add_argument("--synthetic", action="store_true",
                   help="instead, self- and cross-attention on random embeddings with causal and padding "
                        "masks (no model needed); writes their heat maps into --out")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.synthetic:
        from ..demos.synthetic import run as synthetic

        return synthetic(args.out)
    from .command import UserError

    if args.top < 1:
        raise UserError(f"--top must be at least 1, got {args.top}")
    from ..demos import real_model as rm

    t0 = time.perf_counter()
    att = rm.run(args.text, args.model, before_run=lambda config: rm.check_outputs(config, args.out))
    rm.warn_unknown(att, "demo")
    n_layers, n_heads, n = att.shape
    print(f"\"{_clip(att.text)}\" -> {n} tokens: {_clip(' '.join(att.tokens), n)}")
    if att.truncated:
        print(f"(the last {att.truncated} tokens were cut: the model reads at most {n} positions)")
    missing = rm.missing_words(att, args.query, args.key)
    top_heads = []
    if not missing:
        summary, rows = rm.links(att, args.query, args.key, top=args.top)
        print(f"Heads that link \"{args.query}\" to \"{args.key}\" (share of {args.query}'s attention "
              f"that goes to {args.key}, layers and heads from 0):")
        for layer, head, weight, kind in rows:
            print(f"  layer {layer} head {head:<2}  {weight:.3f}" + (f"   ({kind})" if kind else ""))
            top_heads.append((layer, head, f"layer {layer} head {head}: {weight:.2f}"))
        for line in summary:
            print("  " + line)
        if any(kind == "previous-token head" for *_, kind in rows):
            print(f"  (a previous-token head links every word to the one before it: there, \"{args.key}\" -> "
                  f"\"{args.query}\" would be word order, not meaning, if {args.key} comes just before)")
    else:
        print(" and ".join(f'"{w}"' for w in missing) + (" is" if len(missing) == 1 else " are") +
              " not in this text (set --query/--key); the strongest link between two different tokens, per layer:")
        for layer, head, q, k, weight in rm.strongest_pairs(att):
            print(f"  layer {layer} head {head:<2}  {att.tokens[q]} -> {att.tokens[k]}  {weight:.3f}")
            top_heads.append((layer, head, f"layer {layer} head {head}"))
    written = rm.write_outputs(att, args.out, top_heads=top_heads, title="attnkit demo")
    rm.show_written(args.out, written)
    print(f"Done in {time.perf_counter() - t0:.1f} s (model {att.seconds:.1f} s).")
    return 0


def _clip(text: str, n_tokens: int | None = None) -> str:
    """``text`` cut to :data:`ECHO` characters, saying so (and how many tokens there are in all)."""
    if len(text) <= ECHO:
        return text
    return text[:ECHO] + "..." + (f" ({n_tokens} tokens)" if n_tokens is not None else "")
