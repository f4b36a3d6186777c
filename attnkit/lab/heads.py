"""What the heads of a trained model do: MiniLM's 72 heads classified by simple statistics."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import torch

from ..analysis import entropy
from . import Finding
from ._common import figure, minilm, save

CLAIM = ("The heads of a trained Transformer specialise: some look at the previous or next word, some at the "
         "word itself, some at the sentence delimiters, some spread broadly; and the heads that link 'bank' to "
         "'river' are not the ones that link 'bank' to 'China'.")
SUBJECTS = ["the cat", "my brother", "a young doctor", "the old man", "our teacher", "the committee", "she", "they"]
VERBS = ["saw", "visited", "painted", "forgot", "described", "walked past"]
OBJECTS = ["the bank of the river", "a small house", "the red car", "the market in town", "the new bridge",
           "an empty room"]
TAILS = ["yesterday.", "after the storm.", "and then left.", "before dinner."]
KINDS = ("previous", "next", "self", "delimiter")
#: A head is of a kind when on average at least this much of each row's weight goes there.
THRESHOLD = 0.5
#: (sentence, control with the same positions, query word, key word).
BANK_PAIRS = [("the bank of the river was muddy.", "the edge of the river was muddy.", "bank", "river"),
              ("the bank of china raised rates.", "the city of china raised rates.", "bank", "china")]


def sentences(count: int) -> list[str]:
    every = [" ".join(p) for p in itertools.product(SUBJECTS, VERBS, OBJECTS, TAILS)]
    return random.Random(0).sample(every, count)


def head_stats(attn: torch.Tensor, mask: torch.Tensor, delimiters: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per head ``[layers, heads]``: mean weight on the previous, next, own and delimiter tokens
    (over real query tokens), and the mean entropy relative to the uniform row's.

    Args:
        attn: ``[layers, B, H, L, L]`` weights.
        mask: ``[B, L]`` bool, real tokens.
        delimiters: ``[B, L]`` bool, [CLS] and [SEP].
    """
    real = mask[None, :, None, :].float()  # (1, B, 1, L) over query rows
    n_rows = real.sum(dim=(1, 3))

    def mean_over_rows(per_row):  # (layers, B, H, L) -> (layers, H)
        return (per_row * real).sum(dim=(1, 3)) / n_rows

    return {"previous": mean_over_rows(torch.nn.functional.pad(attn.diagonal(-1, -2, -1), (1, 0))),
            "next": mean_over_rows(torch.nn.functional.pad(attn.diagonal(1, -2, -1), (0, 1))),
            "self": mean_over_rows(attn.diagonal(0, -2, -1)),
            "delimiter": mean_over_rows((attn * delimiters[None, :, None, None, :]).sum(-1)),
            "entropy_ratio": (entropy(attn) / torch.log2(mask.sum(-1).float())[None, :, None]).mean(1)}


def classify(stats: dict[str, torch.Tensor]) -> list[list[str]]:
    """Each head's kind: the largest of :data:`KINDS` above :data:`THRESHOLD`, else broad or mixed."""
    layers, heads = stats["self"].shape
    kinds = []
    for layer in range(layers):
        row = []
        for head in range(heads):
            best = max(KINDS, key=lambda k: stats[k][layer, head].item())
            if stats[best][layer, head] >= THRESHOLD:
                row.append(best)
            else:
                row.append("broad" if stats["entropy_ratio"][layer, head] > 0.6 else "mixed")
        kinds.append(row)
    return kinds


def link(model, text: str, query: str, key: str) -> torch.Tensor:
    """``[layers, heads]``: the weight from ``query``'s token to ``key``'s token in ``text``."""
    enc = model.tokenizer([text])
    tokens = model.tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    with torch.no_grad():
        attn = torch.stack(model(enc["input_ids"], enc["attention_mask"], output_attentions=True).attentions)
    return attn[:, 0, :, tokens.index(query), tokens.index(key)]


def run(quick: bool, out: Path) -> Finding:
    model = minilm()
    texts = sentences(48 if quick else 320)
    enc = model.tokenizer(texts)
    ids, mask = enc["input_ids"], enc["attention_mask"].bool()
    special = torch.tensor(model.tokenizer.convert_tokens_to_ids(["[CLS]", "[SEP]"]))
    with torch.no_grad():
        attn = torch.stack(model(ids, enc["attention_mask"], output_attentions=True).attentions)
    stats = head_stats(attn, mask, torch.isin(ids, special))
    kinds = classify(stats)
    counts = {k: sum(row.count(k) for row in kinds) for k in (*KINDS, "broad", "mixed")}
    links = {}
    for text, control, q, k in BANK_PAIRS:
        raw = link(model, text, q, k)
        # The control sentence has another word where "bank" is, at the same positions: what a head
        # gives it is position, so only the excess over it is about the word "bank".
        excess = raw - link(model, control, control.split()[1], k)
        top_raw = divmod(int(raw.argmax()), raw.shape[1])
        top = divmod(int(excess.argmax()), excess.shape[1])
        links[k] = {"top_head_raw": f"layer {top_raw[0]} head {top_raw[1]} ({kinds[top_raw[0]][top_raw[1]]})",
                    "weight_raw": raw.max().item(), "top_head_excess": f"layer {top[0]} head {top[1]}",
                    "excess": excess.max().item(),
                    "top3": {divmod(int(i), raw.shape[1]) for i in excess.flatten().topk(3).indices}}
    overlap = len(links["river"]["top3"] & links["china"]["top3"])
    figures = {"sentences": len(texts), **{f"heads_{k}": v for k, v in counts.items()},
               **{f"{w}_{f}": v for w, d in links.items() for f, v in d.items() if f != "top3"},
               "top3_overlap_river_china": overlap, "kinds_by_layer": {i: " ".join(r) for i, r in enumerate(kinds)}}
    fig, axes = figure(len(KINDS), width=2.3, height=2.6)
    for ax, kind in zip(axes[0], KINDS, strict=True):
        im = ax.imshow(stats[kind].numpy(), vmin=0, vmax=1, cmap="viridis")
        ax.set(title=kind, xlabel="head", ylabel="layer")
    fig.colorbar(im, ax=axes[0][-1])
    pic = save(fig, out / "lab_heads.png")
    specialised = sum(counts[k] for k in KINDS)
    verdict = "supported" if specialised >= 6 and overlap < 3 else "depends"
    why = (f"Over {len(texts)} sentences MiniLM's heads sort into previous-token {counts['previous']}, next-token "
           f"{counts['next']}, self {counts['self']}, delimiter ([CLS]/[SEP]) {counts['delimiter']}, broad "
           f"{counts['broad']} and mixed {counts['mixed']}; after removing what a position-matched control sentence "
           f"gets, the heads that link bank to river ({links['river']['top_head_excess']}) and to China "
           f"({links['china']['top_head_excess']}) share {overlap} of their top 3.")
    kind_words = {"previous": "the previous token", "next": "the next token", "self": "the token itself",
                  "delimiter": "[CLS] or [SEP]"}
    labels = {"sentences": "Sentences",
              **{f"heads_{k}": f"Heads attending to {w}" for k, w in kind_words.items()},
              "heads_broad": "Heads spreading broadly", "heads_mixed": "Heads of mixed kind",
              **{f"{w}_{f}": f"From bank to {w.replace('china', 'China')}: {what}" for w in links for f, what in (
                  ("top_head_raw", "strongest head"), ("weight_raw", "its weight"),
                  ("top_head_excess", "strongest head over the control sentence"),
                  ("excess", "its weight over the control sentence"))},
              "top3_overlap_river_china": "Top-3 heads shared by bank to river and bank to China",
              "kinds_by_layer": f"Kind of each head by layer (heads 0 to {len(kinds[0]) - 1}, left to right)"}
    return Finding("heads", CLAIM, figures, verdict, why, [pic], labels=labels)
