"""Many heads against one at the same width: h = 1, 2, 4, 8 heads of ``embed_dim / h`` each, so every model
has the same parameters, on a task where one position must gather two things at once, and on the lm corpus."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..apps import lm
from ..apps._common import fit, seed_all
from ..modules import MultiHeadAttention
from ..positional import SinusoidalPositionalEncoding
from ._common import figure, save
from .runner import Finding

CLAIM = ("Several heads of width d/h do better than one head of width d at the same parameter count, because each "
         "head can attend to a different place at once; a single softmax head must split its weight between two "
         "things it needs and gets an average of them.")

HEADS = (1, 2, 4, 8)
#: The two-things task: ``LENGTH`` value tokens of ``VALUES``, one marked A and one marked B, then a query token;
#: the answer at the query is ``(a - b) mod VALUES``. It is not symmetric in ``a`` and ``b``, so an even average
#: of the two marked tokens' values does not give it: the head must keep them apart.
VALUES, LENGTH, WIDTH = 8, 12, 32
QUERY = VALUES
NONE, MARK_A, MARK_B = 0, 1, 2


def two_things_batch(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """``(tokens [n, LENGTH + 1], marks [n, LENGTH + 1], answer [n])``: two distinct marked positions among
    the values, the query last."""
    values = torch.randint(VALUES, (n, LENGTH), generator=gen)
    tokens = torch.cat([values, torch.full((n, 1), QUERY)], 1)
    order = torch.rand(n, LENGTH, generator=gen).argsort(-1)
    a, b = order[:, 0], order[:, 1]
    rows = torch.arange(n)
    marks = torch.zeros_like(tokens)
    marks[rows, a], marks[rows, b] = MARK_A, MARK_B
    return tokens, marks, (values[rows, a] - values[rows, b]) % VALUES


class TwoThingsModel(nn.Module):
    """Token + mark embeddings + sinusoidal positions -> one self-attention layer of ``num_heads`` heads
    (residual) -> feed-forward (residual) -> the answer at the query, the last position."""

    def __init__(self, num_heads: int, width: int = WIDTH) -> None:
        super().__init__()
        self.tok, self.mark = nn.Embedding(VALUES + 1, width), nn.Embedding(3, width)
        self.pos = SinusoidalPositionalEncoding(width)
        self.norm1, self.attn = nn.LayerNorm(width), MultiHeadAttention(width, num_heads)
        self.ffn = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.ReLU(),
                                 nn.Linear(4 * width, width))
        self.head = nn.Linear(width, VALUES)

    def forward(self, tokens: Tensor, marks: Tensor) -> Tensor:
        h = self.pos(self.tok(tokens) + self.mark(marks))  # (B, L, E)
        h = h + self.attn(self.norm1(h))
        h = h + self.ffn(h)
        return self.head(h[:, -1])  # (B, VALUES)

    @torch.no_grad()
    def query_weights(self, tokens: Tensor, marks: Tensor) -> Tensor:
        """``[B, H, L]``: each head's attention weights from the query (the last position)."""
        h = self.pos(self.tok(tokens) + self.mark(marks))
        return self.attn(self.norm1(h), need_weights=True)[1][:, :, -1]


def two_things(num_heads: int, seed: int, steps: int) -> dict[str, float]:
    """Train a :class:`TwoThingsModel`; its held-out accuracy and the attention layer's parameters."""
    gen = seed_all(seed)
    model = TwoThingsModel(num_heads)
    fit(model, lambda step: two_things_batch(64, gen), lambda m, b: F.cross_entropy(m(b[0], b[1]), b[2]),
        steps=steps, lr=3e-3, warmup=steps // 10, desc=f"two things, {num_heads} heads", progress=False)
    tokens, marks, answer = two_things_batch(2000, torch.Generator().manual_seed(10_000 + seed))
    with torch.no_grad():
        acc = float((model(tokens, marks).argmax(-1) == answer).float().mean())
    w = model.query_weights(tokens, marks)  # (B, H, L)
    on = {m: (w * (marks == m)[:, None]).sum(-1).mean(0) for m in (MARK_A, MARK_B)}  # (H,): mean weight per head
    return {"accuracy": acc, "attention_params": sum(p.numel() for p in model.attn.parameters()),
            "params": sum(p.numel() for p in model.parameters()),
            "weight_on_a": on[MARK_A].tolist(), "weight_on_b": on[MARK_B].tolist()}


def language_model(num_heads: int, seed: int, cfg: dict, data: lm.Corpus) -> dict[str, float]:
    """Train the lm app's GPT with ``num_heads`` heads; its validation perplexity per character."""
    gen = seed_all(seed)
    model = lm.GPT(vocab_size=len(data.vocab), block_size=cfg["block_size"], embed_dim=cfg["embed_dim"],
                   num_heads=num_heads, num_layers=cfg["num_layers"], ffn_dim=cfg["ffn_dim"], dropout=0.0)
    train = torch.from_numpy(data.train)
    block = cfg["block_size"]

    def batch(step: int) -> Tensor:
        return lm.windows(train, torch.randint(len(train) - block, (cfg["batch_size"],), generator=gen), block + 1)

    fit(model, batch, lambda m, b: F.cross_entropy(m(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()),
        steps=cfg["steps"], lr=cfg["lr"], warmup=cfg["steps"] // 10, desc=f"lm, {num_heads} heads", progress=False)
    val = data.val[:cfg["val_chars"]]
    return {"perplexity": float(torch.tensor(lm.cross_entropy(model, val)).exp()),
            "params": sum(p.numel() for p in model.parameters())}


def spread(xs: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def run(quick: bool, out: Path) -> Finding:
    seeds = range(2 if quick else 3)
    task_steps = 60 if quick else 1000
    lm_cfg = ({"steps": 20, "block_size": 32, "embed_dim": 32, "num_layers": 1, "ffn_dim": 64, "batch_size": 16,
               "lr": 4e-3, "val_chars": 4000, "modules": lm.QUICK["modules"], "min_char_count": 2} if quick else
              {"steps": 300, "block_size": 64, "embed_dim": 64, "num_layers": 2, "ffn_dim": 256, "batch_size": 16,
               "lr": 4e-3, "val_chars": 30_000, "modules": lm.DEFAULTS["modules"], "min_char_count": 20})
    data = lm.corpus(lm_cfg["modules"], min_char_count=lm_cfg["min_char_count"])
    task = {h: [two_things(h, s, task_steps) for s in seeds] for h in HEADS}
    lang = {h: [language_model(h, s, lm_cfg, data) for s in seeds] for h in HEADS}
    acc = {h: spread([r["accuracy"] for r in task[h]]) for h in HEADS}
    ppl = {h: spread([r["perplexity"] for r in lang[h]]) for h in HEADS}
    same_params = (len({r["params"] for rs in task.values() for r in rs}) == 1
                   and len({r["params"] for rs in lang.values() for r in rs}) == 1)
    rows = [{"heads": h, "head_dim": WIDTH // h, "task_accuracy_mean": acc[h]["mean"],
             "task_accuracy_min": acc[h]["min"], "task_accuracy_max": acc[h]["max"],
             "lm_head_dim": lm_cfg["embed_dim"] // h, "lm_perplexity_mean": ppl[h]["mean"],
             "lm_perplexity_min": ppl[h]["min"], "lm_perplexity_max": ppl[h]["max"]} for h in HEADS]
    # "Beats": every run of the many-head model above (below, for perplexity) every run of the one-head one.
    many = [h for h in HEADS if h > 1]
    task_beats = [h for h in many if acc[h]["min"] > acc[1]["max"]]
    task_loses = [h for h in many if acc[h]["max"] < acc[1]["min"]]
    lm_beats = [h for h in many if ppl[h]["max"] < ppl[1]["min"]]
    lm_loses = [h for h in many if ppl[h]["min"] > ppl[1]["max"]]
    best_task = max(HEADS, key=lambda h: acc[h]["mean"])
    best_lm = min(HEADS, key=lambda h: ppl[h]["mean"])
    # The task says something about heads only if some model learned it.
    task_learned = acc[best_task]["mean"] >= 0.5
    one_head = [{"run": i + 1, "accuracy": r["accuracy"], "weight_on_a": r["weight_on_a"][0],
                 "weight_on_b": r["weight_on_b"][0]} for i, r in enumerate(task[1])]
    figures = {"by_heads": rows, "one_head_runs": one_head, "seeds": len(seeds), "task_steps": task_steps,
               "lm_steps": lm_cfg["steps"],
               "same_parameters": same_params, "task_params": task[1][0]["params"],
               "lm_params": lang[1][0]["params"], "chance": 1 / VALUES,
               "task_heads_beating_one": ", ".join(map(str, task_beats)) or "none",
               "lm_heads_beating_one": ", ".join(map(str, lm_beats)) or "none",
               "task_best_heads": best_task, "lm_best_heads": best_lm, "task_learned": task_learned}
    fig, axes = figure(2, width=3.8)
    for ax, stat, name in ((axes[0][0], acc, "two-things accuracy"), (axes[0][1], ppl, "lm perplexity per char")):
        ax.errorbar(HEADS, [stat[h]["mean"] for h in HEADS],
                    yerr=[[stat[h]["mean"] - stat[h]["min"] for h in HEADS],
                          [stat[h]["max"] - stat[h]["mean"] for h in HEADS]], fmt="o-", capsize=3)
        ax.set(xscale="log", xticks=list(HEADS), xticklabels=list(map(str, HEADS)), xlabel="heads (same width)",
               ylabel=name, title=f"{name} (mean, min to max of {len(seeds)} runs)")
    pic = save(fig, out / "lab_heads_vs_one.png")

    def said(beats, loses, unit):
        if beats and not loses:
            return f"{', '.join(map(str, beats))} heads beat one in every run ({unit})"
        if loses and not beats:
            return f"{', '.join(map(str, loses))} heads did worse than one in every run ({unit})"
        if beats:
            return f"{', '.join(map(str, beats))} heads beat one and {', '.join(map(str, loses))} did worse ({unit})"
        return f"no number of heads beat one in every run ({unit})"

    # "Several heads beat one" is supported only for every number of heads measured, not for some of them.
    task_ok = task_learned and task_beats == many
    lm_ok = lm_beats == many
    if task_ok and lm_ok and same_params:
        verdict = "supported"
    elif task_learned and not task_beats and not lm_beats:
        verdict = "refuted"
    else:
        verdict = "depends"
    why = (f"At width {WIDTH} with the same parameters for h = 1, 2, 4, 8 "
           f"({'checked' if same_params else 'NOT the same'}), over {len(seeds)} training runs each (different random "
           "initialisations): on the two-things task "
           f"(output (a - b) mod {VALUES} of the tokens marked A and B, "
           f"{task_steps} steps) mean accuracy was " + ", ".join(f"{acc[h]['mean']:.0%} for {h}" for h in HEADS)
           + f" ({said(task_beats, task_loses, 'the lowest run above the highest one-head run')}"
           + ("" if task_learned else f"; no model learned it: the best mean is below 50%, chance {1 / VALUES:.0%}")
           + f"; one head's runs ranged from {acc[1]['min']:.0%} to {acc[1]['max']:.0%}, and from the query "
           "they put " + ", ".join(f"{r['weight_on_a'][0]:.2f} on A and {r['weight_on_b'][0]:.2f} on B "
                                   f"({r['accuracy']:.0%})" for r in task[1])
           + "); on the lm "
           f"corpus ({lm_cfg['steps']} steps, width {lm_cfg['embed_dim']}) mean validation perplexity per character "
           "was " + ", ".join(f"{ppl[h]['mean']:.2f} for {h}" for h in HEADS)
           + f" ({said(lm_beats, lm_loses, 'every run below every one-head run')}). This is what these sizes "
             "and training budgets give; a different budget can move it.")
    labels = {"by_heads": "Accuracy and perplexity by number of heads", "heads": "Heads",
              "head_dim": "Head width, two-things task", "task_accuracy_mean": "Two-things accuracy, mean",
              "task_accuracy_min": "Two-things accuracy, lowest run",
              "task_accuracy_max": "Two-things accuracy, highest run", "lm_head_dim": "Head width, lm",
              "lm_perplexity_mean": "Lm perplexity per character, mean",
              "lm_perplexity_min": "Lm perplexity per character, lowest run",
              "lm_perplexity_max": "Lm perplexity per character, highest run",
              "seeds": "Training runs per number of heads (different random initialisations)",
              "task_steps": "Training steps, two-things task", "lm_steps": "Training steps, lm",
              "same_parameters": "Same parameter count for every number of heads",
              "task_params": "Parameters, two-things model", "lm_params": "Parameters, lm model",
              "chance": "Chance accuracy, two-things task",
              "task_heads_beating_one": "Heads beating one head in every run, two-things task",
              "lm_heads_beating_one": "Heads beating one head in every run, lm",
              "task_best_heads": "Heads with the best mean accuracy, two-things task",
              "lm_best_heads": "Heads with the best mean perplexity, lm",
              "one_head_runs": "One head on the two-things task: accuracy and the query's weight on A and B, by run",
              "run": "Run", "accuracy": "Accuracy", "weight_on_a": "Weight on A", "weight_on_b": "Weight on B",
              "task_learned": "Some model learned the two-things task (best mean accuracy at least 50%)"}
    return Finding("heads_vs_one", CLAIM, figures, verdict, why, [pic], labels=labels)
