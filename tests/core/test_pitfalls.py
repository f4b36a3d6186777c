"""Each slip in the code of the tutorial articles attnkit teaches from, as a test named for the mistake.

Where the article's code runs, the test runs it as written (statement for statement, its Chinese
comments left out) and shows the slip as it really fails: what raises, what shape comes out, what
a mask really hides. Then it shows what attnkit does with the same input.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnkit
from attnkit import masks
from tests.support.backends import eager_backends
from tests.support.tolerances import close


class ArticleMultiAtten(nn.Module):
    """The multi-head sample's ``Multi_atten``, statement for statement (its Chinese comments left
    out, its shape comments kept as it wrote them, including the wrong ones)."""

    def __init__(self, emd_size, q_k_size, v_size, head):
        super().__init__()
        self.head = head
        self.Wk = nn.Linear(emd_size, q_k_size * head)
        self.Wq = nn.Linear(emd_size, q_k_size * head)
        self.Wv = nn.Linear(emd_size, v_size * head)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x_q, x_k_v, mask):
        q = self.Wq(x_q)  # (batch_size,q_seq_len,q_size*head)
        k = self.Wk(x_k_v)
        v = self.Wv(x_k_v)
        q = q.reshape(q.size()[0], q.size()[1], self.head, -1).transpose(1, 2)  # (batch_size,head,q_seq_len,q_size)
        k = k.reshape(k.size()[0], k.size()[1], self.head, -1).transpose(1, 2)
        v = v.reshape(q.size()[0], v.size()[1], self.head, -1).transpose(1, 2)
        k = k.transpose(2, 3)  # (batch_size,head,k_seq_len,q_size)
        # mask (batch,seq_q,seq_k)
        if mask is not None:
            mask.unsqueeze(1).expand(-1, self.head, -1, -1)
            q_k.masked_fill(mask, 1e-9)  # noqa: F821 -- as written: q_k is assigned on the next line
        q_k = self.softmax(torch.matmul(q, k) / math.sqrt(k.size()[2]))
        atten = torch.matmul(q_k, v)  # (batch_size,head,k_seq_len,k_v_size)
        atten.transpose(1, 2)  # (batch_size,k_seq_len,head,k_v_size)
        atten = atten.reshape(atten.size()[0], atten.size()[1], -1)  # (batch_size, k_seq_len, head*k_v_size)
        return atten


def _sample_module(seed: int = 0) -> ArticleMultiAtten:
    """The sample's module at the sample's sizes: width 128, 8 heads of 16."""
    torch.manual_seed(seed)
    return ArticleMultiAtten(emd_size=128, q_k_size=128 // 8, v_size=128 // 8, head=8)


def _heads_by_attnkit(sample: ArticleMultiAtten, x_q, x_k_v):
    """The sample's projections split into heads the sample's way, attended by attnkit: ``[B, H, Lq, Dv]``."""
    def split(t):
        return t.reshape(t.shape[0], t.shape[1], sample.head, -1).transpose(1, 2)

    with torch.no_grad():
        return attnkit.attention(split(sample.Wq(x_q)), split(sample.Wk(x_k_v)), split(sample.Wv(x_k_v)))


def test_the_mask_branch_reads_the_scores_before_they_exist():
    """The multi-head sample masks ``q_k`` one line before it computes it, so passing any mask
    raises ``UnboundLocalError``: the sample's own demo, which passes one, stops there; only
    ``mask=None`` runs. Moved below that line the branch would still do nothing, because it drops
    what ``expand`` and ``masked_fill`` return (and +1e-9 is no large negative). Fixed, under the
    sample's convention (True hides), it is attnkit's attention with the mask inverted."""
    sample = _sample_module()
    x = torch.rand(1, 5, 128)
    for mask in (torch.randn(1, 5, 5).bool(), torch.zeros(1, 5, 5, dtype=torch.bool), masks.causal(5)[None]):
        with pytest.raises(UnboundLocalError, match="q_k"):
            sample(x, x, mask)
    assert sample(x, x, None).shape == (1, 8, 80)
    # The dropped results: the scores and the mask come out of the branch unchanged.
    scores = torch.randn(1, 8, 5, 5)
    before = scores.clone()
    hide = ~masks.causal(5)[None]
    hide.unsqueeze(1).expand(-1, 8, -1, -1)
    scores.masked_fill(hide, 1e-9)
    assert torch.equal(scores, before) and hide.shape == (1, 5, 5)
    # The branch as meant: hide with -inf after the scores exist, the mask given its head axis.
    q, k, v = (torch.randn(1, 8, 5, 16) for _ in range(3))
    fixed = torch.softmax((q @ k.transpose(2, 3) / math.sqrt(16)).masked_fill(hide.unsqueeze(1), float("-inf")), -1) @ v
    close(fixed, attnkit.attention(q, k, v, mask=~hide[:, None]))
    # attnkit's mask takes effect: hidden keys get exactly 0, and changing them changes nothing.
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[:, 4:] = False
    q, k, v = torch.randn(1, 8, 5, 16), torch.randn(1, 8, 7, 16), torch.randn(1, 8, 7, 16)
    _, w = attnkit.attention(q, k, v, mask=mask, return_weights=True)
    assert (w[..., 4:] == 0).all()
    k2, v2 = k.clone(), v.clone()
    k2[..., 4:, :] = 1e4
    v2[..., 4:, :] = -1e4
    close(attnkit.attention(q, k2, v2, mask=mask), attnkit.attention(q, k, v, mask=mask))


def test_a_mask_made_by_randn_bool_is_all_true():
    """The sample makes its mask with ``torch.randn(...).bool()``: every nonzero number is True and a
    normal draw is never exactly 0, so every entry is True, which means a different thing under
    each convention. The sample's own (``masked_fill(mask, ...)``: True hides) hides every key: with
    its +1e-9 fill every score becomes 1e-9 and every row uniform, with -inf every weight is NaN.
    ``nn.MultiheadAttention``'s boolean ``attn_mask`` (True: not allowed) also hides every key, and
    gives NaN. attnkit's and ``F.scaled_dot_product_attention``'s (True: may attend) hide nothing:
    the same as no mask. No convention gives a random mask."""
    torch.manual_seed(0)
    mask = torch.randn(1, 5, 5).bool()
    assert mask.all()
    q, k, v = (torch.randn(1, 8, 5, 16) for _ in range(3))
    scores = q @ k.transpose(2, 3) / math.sqrt(16)
    hide = mask.unsqueeze(1)  # the sample's convention, with the head axis its branch meant to add
    uniform = torch.softmax(scores.masked_fill(hide, 1e-9), -1)
    close(uniform, torch.full_like(uniform, 1 / 5))
    assert torch.softmax(scores.masked_fill(hide, float("-inf")), -1).isnan().all()
    torch_mha = torch.nn.MultiheadAttention(128, 8, batch_first=True)
    x = torch.randn(1, 5, 128)
    _, w = torch_mha(x, x, x, attn_mask=mask[0])
    assert w.isnan().all()
    close(attnkit.attention(q, k, v, mask=mask[:, None]), attnkit.attention(q, k, v))
    close(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]),
          attnkit.attention(q, k, v))


def test_a_dropped_mask_expand_still_reaches_every_head():
    """The multi-head sample also drops ``mask.unsqueeze(1).expand(...)``; a [B, Lq, Lk] mask must reach all heads."""
    mha = attnkit.MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    mask3 = torch.rand(2, 5, 5) > 0.4
    mask3[..., 0] = True
    _, w = mha(x, mask=mask3, need_weights=True)
    assert ((w > 0) == mask3[:, None]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_minus_1e9_fill_overflows_half_precision(dtype):
    """Two articles fill masked scores with ``-1e9``: in float16 that value does not exist
    (max 65504), so PyTorch refuses. attnkit uses no such constant: masked half-precision
    attention runs, matches float32, and a fully masked row gives zeros, not uniform weights."""
    scores = torch.randn(2, 3, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="overflow"):
        scores.masked_fill(torch.ones(2, 3, dtype=torch.bool), -1e9)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    mask = masks.causal(6)
    mask[3] = False
    for backend in eager_backends():
        out = attnkit.attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask, backend=backend)
        assert torch.isfinite(out).all()
        assert (out[..., 3, :] == 0).all()
        close(out, attnkit.attention(q, k, v, mask=mask), dtype)


def test_the_dropped_transpose_gives_heads_by_positions_times_width():
    """The sample writes ``atten.transpose(1, 2)`` without assigning it, then reshapes
    ``atten.reshape(B, atten.size()[1], -1)``, whose second size is the heads, not the positions:
    the output is ``[B, H, Lq*Dv]``, ``[1, 8, 80]`` at the sample's sizes (5 queries, 8 heads of
    16), not ``[B, L, H*D]`` as its comment says. Each row is one head's whole output, its positions
    side by side. attnkit's module returns ``[B, Lq, E]`` and keeps positions apart: changing query
    token j leaves every other output row unchanged."""
    sample = _sample_module()
    x_q, x_k_v = torch.rand(1, 5, 128), torch.rand(1, 7, 128)
    with torch.no_grad():
        self_out, cross_out = sample(x_q, x_q, None), sample(x_q, x_k_v, None)
    assert self_out.shape == cross_out.shape == (1, 8, 80)
    heads = _heads_by_attnkit(sample, x_q, x_k_v)  # (1, 8, 5, 16)
    close(cross_out, heads.reshape(1, 8, 5 * 16))  # row h: head h, positions 0..4 one after another
    assert heads.transpose(1, 2).reshape(1, 5, 128).shape == (1, 5, 128)  # the merge its comment describes

    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 8).eval()
    xq, xkv = torch.randn(1, 5, 32), torch.randn(1, 7, 32)
    out = mha(xq, xkv)
    assert out.shape == (1, 5, 32)
    xq2 = xq.clone()
    xq2[0, 2] += 3.0
    out2 = mha(xq2, xkv)
    unchanged = [0, 1, 3, 4]
    close(out2[0, unchanged], out[0, unchanged])
    assert not torch.allclose(out2[0, 2], out[0, 2])


def test_v_is_split_with_the_query_batch_size_and_the_shape_comments_are_wrong(monkeypatch):
    """The sample splits ``v`` with ``q.size()[0]``, the queries' batch size, and its comments give
    ``k`` after its transpose as ``(batch, head, k_seq_len, q_size)`` and the weighted sum as
    ``(batch, head, k_seq_len, ...)``. Recorded in cross-attention (5 queries, 7 keys): ``k`` is
    ``(batch, head, q_size, k_seq_len)`` and the weighted sum has ``q_seq_len`` rows. With one
    memory for two queries (keys and values of batch 1, queries of batch 2, as broadcasting would
    allow) ``v`` is silently cut into heads of 8 instead of 16, and the output is ``[2, 8, 40]``;
    with batches of 3 queries and 2 memories the reshape raises. attnkit's module refuses
    different batch sizes, naming the shapes."""
    products = []
    matmul = torch.matmul

    def recording(a, b):
        products.append((tuple(a.shape), tuple(b.shape)))
        return matmul(a, b)

    sample = _sample_module()
    monkeypatch.setattr(torch, "matmul", recording)
    with torch.no_grad():
        sample(torch.rand(1, 5, 128), torch.rand(1, 7, 128), None)
        assert products == [((1, 8, 5, 16), (1, 8, 16, 7)), ((1, 8, 5, 7), (1, 8, 7, 16))]
        products.clear()
        out = sample(torch.rand(2, 5, 128), torch.rand(1, 7, 128), None)
        assert products[1] == ((2, 8, 5, 7), (2, 8, 7, 8))  # v: q's batch of 2, heads of 8, not (1, 8, 7, 16)
        assert out.shape == (2, 8, 40)
        with pytest.raises(RuntimeError, match=r"shape '\[3, 7, 8, -1\]' is invalid"):
            sample(torch.rand(3, 5, 128), torch.rand(2, 7, 128), None)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"must share B.*query \(2, 5, 128\), key \(1, 7, 128\)"):
        attnkit.MultiHeadAttention(128, 8)(torch.rand(2, 5, 128), torch.rand(1, 7, 128))


def _article_sdpa(query, key, value, mask=None):
    """The scaled dot-product sample with a mask docstring, statement for statement (comments left
    out). Its docstring: query ``(B, Lq, Dk)``, key ``(B, Lk, Dk)``, value ``(B, Lk, Dv)``, mask
    ``(B, 1, Lq, Lk)``; output ``(B, Lq, Dv)``."""
    dim_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1))
    scaled_scores = scores / math.sqrt(dim_k)
    if mask is not None:
        scaled_scores = scaled_scores.masked_fill(mask == 0, -1e9)
    attention_weights = torch.nn.functional.softmax(scaled_scores, dim=-1)
    output = torch.matmul(attention_weights, value)
    return output, attention_weights


def test_a_docstring_mask_b_1_lq_lk_on_3d_inputs_broadcasts_to_rank_4():
    """The sample's docstring asks for a ``(B, 1, Lq, Lk)`` mask beside 3-D ``(B, L, D)`` inputs.
    Its code runs with one, without a word: the ``[B, Lq, Lk]`` scores broadcast against the mask
    to ``[B, B, Lq, Lk]``, and the output is ``[B, B, Lq, Dv]``, every batch element's queries under
    every element's mask; only the diagonal ``[b, b]`` is what was meant. attnkit refuses the mask,
    saying which shape it expected."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 10)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[0, ..., 3:] = False  # element 0 has two padded keys
    out, w = _article_sdpa(q, k, v, mask)
    assert out.shape == (2, 2, 3, 10) and w.shape == (2, 2, 3, 5)
    for b in range(2):  # the diagonal: each element under its own mask
        close(out[b, b], attnkit.attention(q[b, None], k[b, None], v[b, None], mask=mask[b, 0])[0])
    assert (w[0, 1, :, 3:] == 0).all()  # element 1's queries under element 0's padding
    one, _ = _article_sdpa(q[:1], k[:1], v[:1], mask[:1])
    assert one.shape == (1, 1, 3, 10)  # batch 1: a rank-4 output where the docstring promises (1, 3, 10)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 3, 5\) is not broadcastable"):
        attnkit.attention(q, k, v, mask=mask)


class _ArticleScaledDotProductAttention(torch.nn.Module):
    """The multi-head sample with a temperature, statement for statement: its comment says
    ``q, k, v: [batch_size, n_heads, seq_len, d_k]``; the mask goes straight into ``masked_fill``."""

    def __init__(self, temperature):
        super().__init__()
        self.temperature = temperature

    def forward(self, q, k, v, mask=None):
        attn = torch.matmul(q, k.transpose(-2, -1))  # [B,N,L,L]
        attn = attn / self.temperature
        if mask is not None:
            attn = attn.masked_fill(mask == 0, -1e9)
        attn = torch.softmax(attn, dim=-1)
        output = torch.matmul(attn, v)
        return output, attn


def test_a_b_l_l_mask_without_a_head_axis_lines_its_batch_up_with_the_heads():
    """A ``[B, L, L]`` padding mask handed to 4-D ``[B, N, L, D]`` attention, with no head axis:
    broadcasting aligns its batch axis with the heads. With as many heads as batch elements it runs
    without a word, head n of every element under element n's mask: element 0's head 1 attends to
    element 0's padding, element 1's head 0 loses a real key. With other sizes it raises. attnkit
    refuses the ambiguous mask and says to pass ``mask[:, None]``."""
    torch.manual_seed(0)
    sdpa = _ArticleScaledDotProductAttention(temperature=math.sqrt(8))
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))
    mask = torch.ones(2, 4, 4, dtype=torch.bool)
    mask[0, :, 3] = False  # element 0's last token is padding
    out, attn = sdpa(q, k, v, mask)
    assert out.shape == (2, 2, 4, 8)
    assert (attn[0, 1, :, 3] > 0).all()  # element 0, head 1: attends to element 0's padding
    assert (attn[1, 0, :, 3] == 0).all()  # element 1, head 0: its real last token is hidden
    close(out, attnkit.attention(q, k, v, mask=mask[None]))  # what it computed: one mask per head
    with pytest.raises(RuntimeError, match="size of tensor a"):
        sdpa(*(torch.randn(3, 2, 4, 8) for _ in range(3)), torch.ones(3, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"ambiguous.*pass mask\[:, None\]"):
        attnkit.attention(q, k, v, mask=mask)
    ok = attnkit.attention(q, k, v, mask=mask[:, None])
    close(ok[0], attnkit.attention(q[0], k[0], v[0], mask=mask[0]))


def test_a_miscounted_parameter_total_is_1048576():
    """The article's parameter count: 8 heads x 3 x 512 x 64 = 786,432 plus the 512 x 512 output projection is
    1,048,576 (it prints 1,032,192). Our module without biases has exactly that many."""
    mha = attnkit.MultiHeadAttention(512, 8, bias=False)
    assert 3 * 512 * 64 == 98_304
    assert sum(p.numel() for p in mha.parameters()) == 8 * 98_304 + 512 * 512 == 1_048_576


def test_a_comment_and_code_of_opposite_mask_polarity():
    """An article's comment says 'when mask is True (or 0)' while its code masks where mask == 0:
    polarity confusion. attnkit has one polarity: True = may attend, and rejects 0/1 ints."""
    q, k, v = (torch.randn(1, 1, 2, 4) for _ in range(3))
    only_first = torch.tensor([[True, False], [True, False]])
    close(attnkit.attention(q, k, v, mask=only_first), v[..., :1, :].expand(1, 1, 2, 4))
    with pytest.raises(TypeError, match="bool"):
        attnkit.attention(q, k, v, mask=only_first.int())


def test_unscaled_scores_have_variance_d_k():
    """An article's Q&A (its question 2.1): with unit-variance q and k, q.k has variance d_k; scaling by 1/sqrt(d_k)
    brings it back to 1, which keeps the softmax out of its flat, small-gradient regime."""
    torch.manual_seed(0)
    d = 256
    q, k = torch.randn(4, 1, 512, d), torch.randn(4, 1, 512, d)
    raw = q @ k.transpose(-2, -1)
    assert 0.8 * d < raw.var().item() < 1.2 * d
    scaled = raw / d**0.5
    assert 0.8 < scaled.var().item() < 1.2
    v = torch.eye(512).expand(4, 1, 512, 512)
    _, w = attnkit.attention(q, k, v, return_weights=True)
    close(w, torch.softmax(scaled, -1), torch.float32)


def test_a_random_boolean_mask_masks_little_and_is_not_causal():
    """``torch.rand(L, L) > 0.1`` used as a mask keeps about 90% of the pairs, the future included:
    an output then changes when a later token changes. A causal mask keeps only the past."""
    torch.manual_seed(0)
    n = 64
    random_mask = torch.rand(n, n) > 0.1
    assert random_mask.float().mean() > 0.85  # masks little
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    assert random_mask[future].float().mean() > 0.85  # most future positions stay visible
    causal = masks.causal(n)
    assert not causal[future].any() and causal[~future].all()
    q, k, v = (torch.randn(1, 1, n, 8) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[..., -1, :] += 5.0
    v2[..., -1, :] += 5.0  # change only the last token
    rows = random_mask[: n - 1, -1].nonzero().flatten()  # earlier rows that see it under the random mask
    assert len(rows) > 0
    changed = attnkit.attention(q, k2, v2, mask=random_mask) - attnkit.attention(q, k, v, mask=random_mask)
    assert changed[..., rows, :].abs().amax() > 1e-3  # the past reads the future
    past = slice(0, n - 1)
    close(attnkit.attention(q, k2, v2, mask=causal)[..., past, :],
          attnkit.attention(q, k, v, mask=causal)[..., past, :])


class _HeadsWithoutOutputProjection(torch.nn.Module):
    """A multi-head module as some tutorials write it: project, split into heads, attend, concatenate,
    and stop there (no W_O)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (p(x).view(b, n, self.heads, e // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        return attnkit.attention(q, k, v).transpose(1, 2).reshape(b, n, e)


def test_without_an_output_projection_heads_cannot_mix():
    """Without W_O, output columns of head h depend only on head h's slice of the projections:
    changing head 1's value weights changes head 1's columns and no others. attnkit's module
    mixes the heads through its output projection, so every column changes."""
    torch.manual_seed(0)
    width, heads = 32, 4
    d = width // heads
    x = torch.randn(2, 6, width)
    head1 = slice(d, 2 * d)
    others = [c for c in range(width) if not d <= c < 2 * d]

    plain = _HeadsWithoutOutputProjection(width, heads)
    before = plain(x)
    with torch.no_grad():
        plain.v_proj.weight[head1] += torch.randn(d, width)
    after = plain(x)
    assert (after - before)[..., head1].abs().amax() > 1e-2
    close(after[..., others], before[..., others])

    mha = attnkit.MultiHeadAttention(width, heads).eval()
    before = mha(x)
    with torch.no_grad():
        mha.v_proj.weight[head1] += torch.randn(d, width)
    moved = (mha(x) - before).abs().amax(dim=(0, 1))
    assert (moved[others] > 1e-3).all()  # every other head's columns moved too


def test_an_eight_head_module_labelled_single_head():
    """A tutorial's "single-head attention" built on ``nn.MultiheadAttention(64, 8)`` has 8 heads:
    8 different weight maps per input. A single head has one map."""

    class SingleHeadAttention(torch.nn.Module):  # as labelled
        def __init__(self, width: int) -> None:
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(width, num_heads=8, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x, average_attn_weights=False)

    torch.manual_seed(0)
    x = torch.randn(1, 5, 64)
    _, w = SingleHeadAttention(64).eval()(x)
    assert w.shape == (1, 8, 5, 5)
    assert all(not torch.allclose(w[0, 0], w[0, h], atol=1e-4) for h in range(1, 8))
    _, one = attnkit.MultiHeadAttention(64, 1).eval()(x, need_weights=True)
    assert one.shape == (1, 1, 5, 5)


def test_separate_q_and_k_weights_are_not_about_lengths():
    """Some tutorials say Q and K need separate weights because input and output lengths differ.
    Lengths have nothing to do with it (a shared projection handles a 5-token query against 7 keys);
    what separate weights buy is asymmetry: with W_q == W_k the scores are symmetric and most tokens
    score themselves highest, while separate weights let a token attend elsewhere."""
    torch.manual_seed(0)
    width, n = 32, 48
    shared = attnkit.MultiHeadAttention(width, 1, share_qk=True).eval()
    assert shared(torch.randn(1, 5, width), torch.randn(1, 7, width)).shape == (1, 5, width)
    separate = attnkit.MultiHeadAttention(width, 1).eval()
    x = torch.randn(1, n, width)
    argmax_self = {}
    for name, mha in (("shared", shared), ("separate", separate)):
        q, k, _ = mha.project_qkv(x, x, x)
        scores = (q @ k.transpose(-1, -2))[0, 0]
        argmax_self[name] = (scores.argmax(-1) == torch.arange(n)).float().mean().item()
        if name == "shared":
            close(scores, scores.T, atol=1e-5, rtol=0)
        else:
            assert (scores - scores.T).abs().amax() > 0.1
    assert argmax_self["shared"] > 0.8
    assert argmax_self["separate"] < 0.3
