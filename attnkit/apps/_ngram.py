"""Smoothed n-gram language models over integer ids: the baselines a small GPT must beat.

Each order is smoothed towards the order below it with a Dirichlet prior (the interpolation of
MacKay and Peto 1995, "A hierarchical Dirichlet language model")::

    P_0(c)         = 1 / V
    P_k(c | h)     = (N(h c) + alpha * P_{k-1}(c | h')) / (N(h) + alpha)

where ``h`` is the last ``k - 1`` ids, ``h'`` its last ``k - 2``, ``N(h c)`` the count of the
k-gram in the training ids and ``N(h) = sum_c N(h c)``, so every row sums to 1 and an unseen
id never gets probability 0. With ``alpha = V`` the unigram level is add-one (Laplace) smoothing.
The tables are dense ``V^k`` arrays: meant for character vocabularies (``V`` about 100, ``k <= 3``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: The concentrations :func:`fit` chooses ``alpha`` from.
ALPHAS: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
MAX_ORDER = 3


class NGram:
    """An order-``order`` model with one ``alpha`` at every level; ``probs[k - 1]`` is ``P_k`` as a
    ``[V] * k`` array (the last axis is the predicted id).

    Args:
        ids: the training ids, int in ``[0, V)``.
        vocab_size: ``V``.
        order: 1 (unigram), 2 (bigram) or 3 (trigram).
        alpha: the Dirichlet concentration, > 0.
    """

    def __init__(self, ids: np.ndarray, vocab_size: int, *, order: int, alpha: float) -> None:
        if order not in range(1, MAX_ORDER + 1):
            raise ValueError(f"order must be 1, 2 or 3, got {order!r}")
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha!r}")
        ids = _check_ids(ids, vocab_size)
        self.order, self.alpha, self.vocab_size = order, float(alpha), vocab_size
        lower = np.full(vocab_size, 1.0 / vocab_size)  # P_0, broadcast over every context
        self.probs: list[np.ndarray] = []
        for k in range(1, order + 1):
            counts = _counts(ids, vocab_size, k)  # [V] * k
            context = counts.sum(-1, keepdims=True)  # N(h)
            # P_{k-1}(c | h') does not depend on h's first id: broadcast over that axis.
            p = (counts + alpha * lower) / (context + alpha)
            self.probs.append(p)
            lower = p

    def log_probs(self, ids: np.ndarray) -> np.ndarray:
        """``log P(ids[t] | ids[:t])`` for ``t = 1 .. len(ids) - 1``, in nats.

        Each id is predicted from the ``order - 1`` ids before it; the first ids of ``ids``,
        which have fewer before them, from as many as there are (the lower orders).
        """
        ids = _check_ids(ids, self.vocab_size)
        out = np.empty(len(ids) - 1)
        for t in range(1, min(self.order - 2, len(ids) - 1) + 1):  # the short contexts at the start
            out[t - 1] = self.probs[t][tuple(ids[: t + 1])]
        k = self.order
        if len(ids) > k - 1:
            grams = tuple(ids[j: len(ids) - (k - 1) + j] for j in range(k))  # k-grams ending at t >= k-1
            out[max(k - 2, 0):] = self.probs[k - 1][grams][1 if k == 1 else 0:]
        return np.log(out)

    def cross_entropy(self, ids: np.ndarray) -> float:
        """Mean ``-log P`` per predicted id of ``ids[1:]``, in nats."""
        return float(-self.log_probs(ids).mean())


def fit(train: np.ndarray, vocab_size: int, *, order: int, alphas: Sequence[float] = ALPHAS,
        held_out: float = 0.1) -> NGram:
    """An :class:`NGram` whose ``alpha`` is chosen on the training ids alone.

    Counts are taken on the first ``1 - held_out`` of ``train``; the ``alpha`` of ``alphas`` with
    the lowest cross-entropy on the rest is kept, and the model is counted again on all of
    ``train`` with it. The validation text is never looked at.
    """
    train = _check_ids(train, vocab_size)
    cut = int(len(train) * (1 - held_out))
    if cut < order or len(train) - cut < 2:
        raise ValueError(f"train has {len(train)} ids: too few to hold out {held_out:.0%} for choosing alpha")
    scores = {a: NGram(train[:cut], vocab_size, order=order, alpha=a).cross_entropy(train[cut:]) for a in alphas}
    best = min(scores, key=scores.__getitem__)
    return NGram(train, vocab_size, order=order, alpha=best)


def perplexity(cross_entropy: float) -> float:
    """``exp(cross_entropy)`` for a cross-entropy in nats."""
    return math.exp(cross_entropy)


def _counts(ids: np.ndarray, vocab_size: int, k: int) -> np.ndarray:
    flat = np.zeros(len(ids) - k + 1, dtype=np.int64)
    for j in range(k):
        flat = flat * vocab_size + ids[j: len(ids) - k + 1 + j]
    return np.bincount(flat, minlength=vocab_size**k).astype(np.float64).reshape((vocab_size,) * k)


def _check_ids(ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or len(ids) < 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be a 1-D integer array of at least 2 ids, got {ids.dtype} of shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"ids must lie in [0, {vocab_size}), got {ids.min()} .. {ids.max()}")
    return ids.astype(np.int64)
