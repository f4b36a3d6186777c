"""A Bahdanau-style RNN encoder-decoder: the model attention was first built into, as a baseline.

Bahdanau, Cho and Bengio 2015, "Neural Machine Translation by Jointly Learning to Align and
Translate". A bidirectional GRU reads the source; a GRU decoder writes the target one token at a
time, and before each token it attends over every source state with an *additive* score::

    e_tj = v . tanh(W s_{t-1} + U h_j)              s: decoder state, h_j: source state j
    a_t  = softmax(e_t) over the real source tokens   (padding gets weight 0)
    c_t  = sum_j a_tj h_j                             the context
    s_t  = GRU(s_{t-1}, [emb(y_{t-1}); c_t])
    p(y_t | ...) = softmax(out([s_t; c_t; emb(y_{t-1})]))

``s_0 = tanh(W_0 h_1^backward)``, the backward GRU's state after reading the whole source, as in
the paper. Two simplifications: torch's own ``nn.GRU`` / ``nn.GRUCell`` (not the paper's
hand-written cells), and the output layer is one linear map instead of the paper's maxout layer.

The score is attnkit's: :class:`attnkit.approx.scores.AdditiveScores` builds ``e`` (the same
blocks ``attnkit.approx.attention(kind="additive")`` uses), and :func:`attnkit.attention` masks,
normalises and weighs the values with it, returning the weights the alignment picture draws.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..approx.scores import AdditiveScores
from ..functional import attention


def _lengths(mask: Tensor, length: int) -> Tensor:
    """Each row's count of real tokens, checking that they come first (padding at the end only)."""
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"src_key_mask must be a bool [B, Ls] tensor (True at real tokens), got "
                         f"{mask.dtype} of shape {tuple(mask.shape)}")
    if mask.shape[1] != length:
        raise ValueError(f"src_key_mask has {mask.shape[1]} positions, but the source has {length}")
    n = mask.sum(1)
    if not (n > 0).all():
        raise ValueError("src_key_mask has a row without a real token; every source needs at least one")
    if not torch.equal(mask, torch.arange(length, device=mask.device) < n[:, None]):
        raise ValueError("src_key_mask must be True on a prefix of each row (the recurrent encoder reads "
                         "real tokens first, padding after them)")
    return n


class AdditiveAttention(nn.Module):
    """Additive attention of one query over a sequence: ``score(s, h) = v . tanh(W s + U h)``.

    Shape notation: ``B`` batch, ``Ls`` source length, ``Dq`` query size, ``Dk`` key (and
    value) size, ``A`` the score's hidden size.

    The keys' projection ``U h`` does not change while a target is written, so it is made once
    (:meth:`project_keys`) and passed to every step.

    Args:
        query_dim: ``Dq``, the decoder state's size.
        key_dim: ``Dk``, the source states' size.
        attn_dim: ``A``.

    Plain PyTorch, for a reader::

        e = torch.tanh(W(s)[:, None, :] + U(h)) @ v                  # [B, Ls]
        a = e.masked_fill(~mask, float("-inf")).softmax(-1)
        c = (a[:, :, None] * h).sum(1)                               # [B, Dk]
    """

    def __init__(self, query_dim: int, key_dim: int, attn_dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(query_dim, attn_dim, bias=False)  # W; U's bias serves both
        self.k_proj = nn.Linear(key_dim, attn_dim)  # U
        bound = 1.0 / math.sqrt(attn_dim)
        self.score_vector = nn.Parameter(torch.empty(attn_dim).uniform_(-bound, bound))  # v

    def project_keys(self, keys: Tensor) -> Tensor:
        """``U h``: ``[B, Ls, Dk] -> [B, Ls, A]``."""
        return self.k_proj(keys)

    def forward(self, query: Tensor, keys: Tensor, values: Tensor,
                mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The context and the weights for one query per row.

        Args:
            query: ``[B, Dq]``, the decoder state ``s``.
            keys: ``[B, Ls, A]``, from :meth:`project_keys`.
            values: ``[B, Ls, Dk]``, the source states ``h``.
            mask: bool ``[B, Ls]``, ``True`` at real tokens; ``None``: every position is real.

        Returns:
            ``(context [B, Dk], weights [B, Ls])``; each row of weights sums to 1 over its real
            positions and is 0 on padding.
        """
        q = self.q_proj(query)[:, None, None, :]  # (B, 1, 1, A): one head, one query
        scores = AdditiveScores.apply(q, keys[:, None], self.score_vector)  # (B, 1, 1, Ls)
        # The score is the whole logit: scale 0 drops the dot product of the empty (size-1) q and k.
        zero_q, zero_k = q.new_zeros(q.shape[:-1] + (1,)), keys.new_zeros(keys.shape[:-1] + (1,))[:, None]
        context, weights = attention(zero_q, zero_k, values[:, None], bias=scores, scale=0.0,
                                     mask=None if mask is None else mask[:, None, None, :], return_weights=True)
        return context[:, 0, 0], weights[:, 0, 0]


class Encoded(NamedTuple):
    """What :meth:`RNNSeq2Seq.encode` hands the decoder."""

    states: Tensor  # (B, Ls, 2H): [forward; backward] GRU state at each source token, 0 on padding
    keys: Tensor  # (B, Ls, A): the states through the attention's U
    state: Tensor  # (B, H): the decoder's first state s_0


class RNNSeq2Seq(nn.Module):
    """Bidirectional GRU encoder, GRU decoder with additive attention (the module docstring's equations).

    Args:
        src_vocab: source vocabulary size.
        tgt_vocab: target vocabulary size.
        tgt_len: the longest target, <eos> included.
        bos_id: the token the decoder starts from.
        embed_dim: token embedding size (source and target).
        hidden_dim: ``H``, each GRU direction's and the decoder's state size.
        attn_dim: the additive score's hidden size.
    """

    def __init__(self, src_vocab: int, tgt_vocab: int, tgt_len: int, *, bos_id: int, embed_dim: int,
                 hidden_dim: int, attn_dim: int) -> None:
        super().__init__()
        self.tgt_len, self.bos_id = tgt_len, bos_id
        self.src_embed = nn.Embedding(src_vocab, embed_dim)
        self.tgt_embed = nn.Embedding(tgt_vocab, embed_dim)
        self.encoder = nn.GRU(embed_dim, hidden_dim, batch_first=True, bidirectional=True)
        self.init_state = nn.Linear(hidden_dim, hidden_dim)  # W_0
        self.attention = AdditiveAttention(hidden_dim, 2 * hidden_dim, attn_dim)
        self.decoder = nn.GRUCell(embed_dim + 2 * hidden_dim, hidden_dim)
        self.head = nn.Linear(hidden_dim + 2 * hidden_dim + embed_dim, tgt_vocab)

    def encode(self, src: Tensor, src_key_mask: Tensor | None = None) -> Encoded:
        """``src [B, Ls]`` -> :class:`Encoded`; ``src_key_mask [B, Ls]`` is ``True`` at real tokens,
        which must come first in each row (the backward GRU starts at each row's last real token).

        Raises:
            ValueError: the mask is not bool ``[B, Ls]``, has a row without a real token, or has
                padding before a real token.
        """
        x = self.src_embed(src)  # (B, Ls, E)
        if src_key_mask is None:
            states, last = self.encoder(x)
        else:
            n = _lengths(src_key_mask, src.shape[1])
            packed = pack_padded_sequence(x, n.cpu(), batch_first=True, enforce_sorted=False)
            states, last = self.encoder(packed)
            states, _ = pad_packed_sequence(states, batch_first=True, total_length=src.shape[1])
        # last: (2, B, H), forward and backward final states; the backward one has read the whole row
        return Encoded(states, self.attention.project_keys(states), torch.tanh(self.init_state(last[1])))

    def step(self, tok: Tensor, state: Tensor, enc: Encoded,
             src_key_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One target token: ``tok [B]`` (the previous one) and ``state [B, H]`` ->
        ``(logits [B, V], next state [B, H], attention weights [B, Ls])``."""
        emb = self.tgt_embed(tok)  # (B, E)
        context, weights = self.attention(state, enc.keys, enc.states, src_key_mask)  # (B, 2H), (B, Ls)
        state = self.decoder(torch.cat([emb, context], dim=-1), state)
        return self.head(torch.cat([state, context, emb], dim=-1)), state, weights

    def decode(self, tgt_in: Tensor, enc: Encoded, src_key_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Teacher forcing over ``tgt_in [B, Lt]``: ``(logits [B, Lt, V], weights [B, Lt, Ls])``."""
        state, logits, weights = enc.state, [], []
        for t in range(tgt_in.shape[1]):
            out, state, w = self.step(tgt_in[:, t], state, enc, src_key_mask)
            logits.append(out)
            weights.append(w)
        return torch.stack(logits, dim=1), torch.stack(weights, dim=1)

    def forward(self, src: Tensor, tgt: Tensor, src_key_mask: Tensor | None = None) -> Tensor:
        """Teacher forcing: logits ``[B, Lt, V]`` predicting ``tgt [B, Lt]`` from <bos> + ``tgt[:, :-1]``,
        as :class:`attnkit.apps.translate.Seq2Seq` does."""
        tgt_in = torch.cat([torch.full_like(tgt[:, :1], self.bos_id), tgt[:, :-1]], dim=1)
        return self.decode(tgt_in, self.encode(src, src_key_mask), src_key_mask)[0]
