"""An independent recheck of nine ``attnkit lab`` experiments, from first principles with torch.

Nothing here imports :mod:`attnkit.lab`: each function recomputes a key figure its own way (other
sentences, other random draws, torch's own FLOP counter, autograd's own Jacobians), so that
tests/lab/test_lab.py can hold the lab's verdicts and figures against them. MiniLM comes from
:class:`attnkit.models.Bert` (the model, not the lab).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

#: Sentences of another shape than the lab's, for classifying MiniLM's heads.
SENTENCES = [
    "the river flooded the fields last spring.",
    "my sister bought three apples at the market.",
    "a quiet dog slept under the kitchen table.",
    "they argued about the price of the old boat.",
    "the train to the coast left two hours late.",
    "our neighbour painted the fence a bright green.",
    "he wrote a long letter to the city council.",
    "the children played football until it got dark.",
    "she found her keys in the pocket of her coat.",
    "the museum opened a new hall for modern art.",
    "a strong wind broke several branches of the tree.",
    "we cooked dinner while the radio played jazz.",
]
#: A head is of a kind when on average at least this share of each real row's weight goes there.
THRESHOLD = 0.5


def minilm():
    from attnkit.models import Bert

    return Bert.from_pretrained()


def head_kinds(model, texts: list[str] = SENTENCES, threshold: float = THRESHOLD) -> dict[str, int]:
    """How many of MiniLM's heads put, on average over real query tokens, at least ``threshold`` of
    their weight on the previous token, the next, the token itself or the delimiters, by kind
    (the largest such share wins); ``positional`` is previous + next + self."""
    counts = {"previous": 0, "next": 0, "self": 0, "delimiter": 0}
    enc = model.tokenizer(texts)
    ids, mask = enc["input_ids"], enc["attention_mask"].bool()
    delim = torch.isin(ids, torch.tensor(model.tokenizer.convert_tokens_to_ids(["[CLS]", "[SEP]"])))
    with torch.no_grad():
        attns = model(ids, enc["attention_mask"], output_attentions=True).attentions
    lengths = mask.sum(-1)
    for w in attns:  # (B, H, L, L)
        for h in range(w.shape[1]):
            share = {k: [] for k in counts}
            for b in range(w.shape[0]):
                n = int(lengths[b])
                a = w[b, h, :n, :n]
                share["self"].append(a.diagonal().mean())
                share["previous"].append(torch.cat([a.new_zeros(1), a.diagonal(-1)]).mean())
                share["next"].append(torch.cat([a.diagonal(1), a.new_zeros(1)]).mean())
                share["delimiter"].append(a[:, delim[b, :n]].sum(-1).mean())
            means = {k: float(torch.stack(v).mean()) for k, v in share.items()}
            best = max(means, key=means.get)
            if means[best] >= threshold:
                counts[best] += 1
    return {**counts, "positional": counts["previous"] + counts["next"] + counts["self"],
            "specialised": sum(counts.values())}


def bank_layer0_inputs_differ(model, texts=("the bank of the river was muddy.",
                                            "the bank of china raised rates.")) -> float:
    """Largest difference between the embeddings (layer 0's input) of "bank" in the two sentences:
    the same word at the same position, so 0; what a layer-0 head does differently there comes
    from the other words."""
    vecs = []
    for text in texts:
        enc = model.tokenizer([text])
        pos = model.tokenizer.convert_ids_to_tokens(enc["input_ids"][0]).index("bank")
        with torch.no_grad():
            hidden = model(enc["input_ids"], enc["attention_mask"], output_hidden_states=True).hidden_states
        vecs.append(hidden[0][0, pos])
    return float((vecs[0] - vecs[1]).abs().max())


def softmax_jacobian_trace(scores: torch.Tensor) -> float:
    """Mean trace of each row's softmax Jacobian, taken by autograd (not from the formula a(1-a))."""
    def one(row):
        return torch.autograd.functional.jacobian(lambda s: s.softmax(-1), row).diagonal().sum()
    return float(torch.stack([one(r) for r in scores]).mean())


def scaling_recheck(dims=(16, 64, 256, 1024, 4096), rows: int = 32, keys: int = 64,
                    seed: int = 1234) -> dict[int, dict[str, float]]:
    """Per ``d_k``, from unit-variance random q, k, v: the softmax Jacobian trace scaled and unscaled,
    and the norm of the gradient of a random projection of the output with respect to q."""
    gen = torch.Generator().manual_seed(seed)
    res = {}
    for d in dims:
        q = torch.randn(rows, d, generator=gen, dtype=torch.float64)
        k = torch.randn(keys, d, generator=gen, dtype=torch.float64)
        v = torch.randn(keys, d, generator=gen, dtype=torch.float64)
        direction = torch.randn(rows, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
        row = {}
        for name, scale in (("unscaled", 1.0), ("scaled", d ** -0.5)):
            qq = q.clone().requires_grad_(True)
            scores = qq @ k.T * scale
            ((scores.softmax(-1) @ v) * direction).sum().backward()
            row[f"grad_q_{name}"] = float(qq.grad.norm(dim=-1).mean())
            row[f"trace_{name}"] = softmax_jacobian_trace(scores.detach())
        res[d] = row
    return res


def rnn_flops(n: int, d: int) -> int:
    """FLOPs of ``nn.RNNCell(d, d)`` over ``n`` steps as torch's FLOP counter counts them, checked
    against the cell's weight shapes (input-to-hidden and hidden-to-hidden: 2 FLOPs per multiply-add)."""
    torch.manual_seed(0)
    cell, h = nn.RNNCell(d, d), torch.zeros(1, d)
    x = torch.randn(n, 1, d)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        for i in range(n):
            h = cell(x[i], h)
    counted = counter.get_total_flops()
    from_shapes = 2 * n * (cell.weight_ih.shape[0] * cell.weight_ih.shape[1]
                           + cell.weight_hh.shape[0] * cell.weight_hh.shape[1])
    assert counted == from_shapes, (counted, from_shapes)
    return counted


def accuracy_claim_status(accuracies: dict[str, float], ceiling: float = 0.99, margin: float = 0.05) -> str:
    """Whether "the dot product is as accurate" was tested by these accuracies: ``untested`` when
    every score function is at the task's ceiling, else ``holds`` or ``fails``."""
    if min(accuracies.values()) >= ceiling:
        return "untested"
    return "holds" if accuracies["dot"] >= max(accuracies.values()) - margin else "fails"


def own_score_wins(x: torch.Tensor) -> list[bool]:
    """For the rows of ``x [L, E]``, one by one in a loop: whether the row's dot product with itself
    is strictly larger than with every other row (no projections: q = k = x)."""
    wins = []
    for i in range(x.shape[0]):
        own = float(x[i] @ x[i])
        wins.append(all(own > float(x[i] @ x[j]) for j in range(x.shape[0]) if j != i))
    return wins


def equal_norm_rows(n: int = 24, d: int = 32, seed: int = 4321) -> torch.Tensor:
    """``n`` random directions in ``d`` dimensions, each scaled to norm 3 (float64)."""
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return 3 * x / x.norm(dim=-1, keepdim=True)


def unequal_norm_counterexample(d: int = 8, seed: int = 4321) -> tuple[float, float, float]:
    """A random word and the same word 1.5 times longer: ``(own score, score with the longer one,
    weight on itself under softmax(x x^T / sqrt(d)))`` for the first."""
    x = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    pair = torch.stack([x, 1.5 * x])
    scores = pair @ pair.T
    return float(scores[0, 0]), float(scores[0, 1]), float(torch.softmax(scores[0] / math.sqrt(d), -1)[0])


def minilm_self_attention(model, texts: list[str] = SENTENCES) -> dict[str, float]:
    """On MiniLM's input embeddings of ``texts`` (not the lab's sentences), with q = k = v = x and
    no projections: the mean weight of each real token on itself under ``softmax(x x^T / sqrt(E))``
    over the real tokens, and the share of real tokens whose own score beats every other one."""
    enc = model.tokenizer(texts)
    lengths = enc["attention_mask"].sum(-1)
    with torch.no_grad():
        emb = model(enc["input_ids"], enc["attention_mask"], output_hidden_states=True).hidden_states[0].double()
    self_weights, wins = [], []
    for b in range(emb.shape[0]):
        x = emb[b, : int(lengths[b])]
        self_weights += torch.softmax(x @ x.T / math.sqrt(x.shape[-1]), -1).diagonal().tolist()
        wins += own_score_wins(x)
    return {"self_weight": sum(self_weights) / len(self_weights), "own_score_wins": sum(wins) / len(wins)}


def shared_qk_scores(n: int = 10, d: int = 16, seed: int = 4321) -> tuple[float, float]:
    """With one matrix ``W`` for queries and keys, ``S = (x W)(x W)^T``: ``(max |S - S^T|, max
    |diag S - |x W|^2|)``; both 0 up to rounding (float64)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = torch.randn(d, d, generator=gen, dtype=torch.float64)
    s = (x @ w) @ (x @ w).T
    return float((s - s.T).abs().max()), float((s.diagonal() - (x @ w).pow(2).sum(-1)).abs().max())


def sharing_claim_status(heldout: dict[str, list[float]], train: dict[str, list[float]],
                         little: float = 0.05) -> dict[str, str]:
    """What per-seed accuracies say about sharing's two accuracy claims, from ``heldout`` and
    ``train`` accuracies keyed ``"VARIANT POOL"`` (``"separate 64"``, ``"share_qk 256"``, ...).

    ``kv_little_cost``: ``untested`` with fewer than two seeds; else ``holds`` when K = V's mean
    accuracy on unseen sequences is within ``little`` of separate projections' at every pool where
    both ran. ``qk_generalises_poorly``: ``untested`` with fewer than two seeds or one pool size; else
    ``holds`` when at every pool Q = K's smallest gap (training minus unseen) exceeds separate's
    largest, ``fails`` otherwise.
    """
    def mean(v):
        return sum(v) / len(v)

    pools = sorted({int(k.split()[1]) for k in heldout})
    seeds = min(len(v) for v in heldout.values())
    if seeds < 2:
        return {"kv_little_cost": "untested", "qk_generalises_poorly": "untested"}
    kv_pools = [p for p in pools if f"share_kv {p}" in heldout]
    kv = all(mean(heldout[f"share_kv {p}"]) >= mean(heldout[f"separate {p}"]) - little for p in kv_pools)

    def gaps(key):
        return [t - h for t, h in zip(train[key], heldout[key], strict=True)]

    qk = all(min(gaps(f"share_qk {p}")) > max(gaps(f"separate {p}")) for p in pools)
    return {"kv_little_cost": ("holds" if kv else "fails") if kv_pools else "untested",
            "qk_generalises_poorly": "untested" if len(pools) < 2 else ("holds" if qk else "fails")}


# ------------------------------------------------------------------ conv_attention


def conv_by_shifts(image: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: int) -> torch.Tensor:
    """A convolution as K*K attention heads whose weight matrices are written out as one-hot shifts (built
    with loops over pixels, no masks, no scores): ``sum_h P_h X W_h + bias`` on the zero-padded image."""
    b, c_in, height, width = image.shape
    c_out, _, k, _ = weight.shape
    r = k // 2
    padded = torch.nn.functional.pad(image, (padding,) * 4)
    gh, gw = padded.shape[-2:]
    x = padded.flatten(2).transpose(1, 2)  # (B, N, C_in)
    out = torch.zeros(b, gh * gw, c_out, dtype=image.dtype)
    for dy in range(-r, r + 1):
        for dx in range(-r, r + 1):
            p = torch.zeros(gh * gw, gh * gw, dtype=image.dtype)
            for y in range(gh):
                for xx in range(gw):
                    if 0 <= y + dy < gh and 0 <= xx + dx < gw:
                        p[y * gw + xx, (y + dy) * gw + xx + dx] = 1.0
            out = out + p @ x @ weight[:, :, dy + r, dx + r].T
    if bias is not None:
        out = out + bias
    return out.transpose(1, 2).reshape(b, c_out, gh, gw)[:, :, r:gh - r, r:gw - r]


def positional_weights(image: torch.Tensor, alpha: float, w_q: torch.Tensor | None = None,
                       w_k: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, N, N]``: one head's softmax over ``-alpha |key - query - (1, 1)|^2`` (the offset down-right)
    plus, if given, the content score ``(x w_q) . (x w_k) / sqrt(D)``, over the pixels of ``image``."""
    _, _, height, width = image.shape
    pos = torch.tensor([(y, x) for y in range(height) for x in range(width)], dtype=image.dtype)
    delta = pos[None, :, :] - pos[:, None, :] - torch.tensor([1.0, 1.0], dtype=image.dtype)
    scores = (-alpha * (delta ** 2).sum(-1))[None]
    if w_q is not None:
        x = image.flatten(2).transpose(1, 2)
        scores = scores + (x @ w_q) @ (x @ w_k).transpose(1, 2) / math.sqrt(w_q.shape[-1])
    return scores.softmax(-1)


# ------------------------------------------------------------------ before_attention


def rnn_gradient_ratio(scale: float, *, steps: int = 64, hidden: int = 64, input_std: float = 1.0,
                       seed: int = 7) -> float:
    """torch's own ``nn.RNN`` (tanh, recurrent weights an orthogonal matrix times ``scale``, no biases):
    the gradient norm of a random projection of the last state with respect to the first input, over
    that with respect to the last input."""
    gen = torch.Generator().manual_seed(seed)
    rnn = nn.RNN(hidden, hidden, bias=False, batch_first=True).double()
    q, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=gen, dtype=torch.float64))
    with torch.no_grad():
        rnn.weight_hh_l0.copy_(scale * q)
        rnn.weight_ih_l0.copy_(torch.randn(hidden, hidden, generator=gen, dtype=torch.float64) / math.sqrt(hidden))
    x = (input_std * torch.randn(16, steps, hidden, generator=gen, dtype=torch.float64)).requires_grad_(True)
    out, _ = rnn(x)
    u = torch.randn(16, hidden, generator=gen, dtype=torch.float64)
    (g,) = torch.autograd.grad((u * out[:, -1]).sum(), x)
    norms = g.norm(dim=-1).mean(0)
    return float(norms[0] / norms[-1])


def linear_gradient_factor(scale: float, *, steps: int = 64, hidden: int = 64, seed: int = 7) -> float:
    """For ``h_t = W_hh h_{t-1} + W_ih x_t`` the gradient reaching ``x_{T-d}`` is ``(W_hh^d W_ih)^T u``:
    the geometric-mean growth per step of its norm, from matrix powers (no autograd)."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=gen, dtype=torch.float64))
    w_ih = torch.randn(hidden, hidden, generator=gen, dtype=torch.float64)
    u = torch.randn(hidden, generator=gen, dtype=torch.float64)
    first = (w_ih.T @ u).norm()
    last = (w_ih.T @ torch.linalg.matrix_power(scale * q, steps - 1).T @ u).norm()
    return float((last / first) ** (1 / (steps - 1)))


# ------------------------------------------------------------------ heads_vs_one


def mha_params_by_heads(width: int, heads=(1, 2, 4, 8)) -> dict[int, int]:
    """Parameters of torch's own ``nn.MultiheadAttention(width, h)`` for each ``h``."""
    return {h: sum(p.numel() for p in nn.MultiheadAttention(width, h).parameters()) for h in heads}


# ------------------------------------------------------------------ heads: dependency arcs


def best_head_by_relation(model, path) -> dict[str, float]:
    """Per relation of the arcs file at ``path`` (read here with its own parser): the best accuracy, over
    MiniLM's heads, of "the word this word attends to most (itself left out) is its head word", and the
    accuracy of "the head word is the next word". Every word of the file is one token (checked)."""
    hits: dict[str, list[torch.Tensor]] = {}
    right: dict[str, list[bool]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        items = line.split()
        words = [item.split("/")[0] for item in items]
        enc = model.tokenizer([" ".join(words)])
        assert len(enc["input_ids"][0]) == len(words) + 2, words  # one token per word, [CLS] and [SEP]
        with torch.no_grad():
            attn = torch.stack(model(enc["input_ids"], enc["attention_mask"], output_attentions=True).attentions)
        attn = attn[:, 0, :, 1:-1, 1:-1].clone()  # (layers, H, n, n): words only
        n = len(words)
        attn[..., torch.arange(n), torch.arange(n)] = -1.0
        for i, item in enumerate(items):
            if "/" not in item:
                continue
            rel, head = item.split("/")[1].split(":")
            head = int(head) - 1
            hits.setdefault(rel, []).append(attn[..., i, :].argmax(-1) == head)
            right.setdefault(rel, []).append(head == i + 1)
    return {rel: {"best": float(torch.stack(h).double().mean(0).max()),
                  "right_word": sum(right[rel]) / len(right[rel]), "arcs": len(h)} for rel, h in hits.items()}
