"""Each bug found in the seed articles' code, written as a test that attnkit passes.

The seeds are in ../shared/seeds/. Where it helps, a test first shows the pitfall happening with
the seed's own idiom, then shows that attnkit cannot fall into it.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from tests.support.backends import eager_backends
from tests.support.tolerances import close


def test_seed001_mask_is_actually_applied():
    """Seed 001 calls ``q_k.masked_fill(mask, 1e-9)`` and drops the result (and fills with +1e-9
    instead of a large negative number), so its mask never masks. Ours: masked keys get exactly
    zero weight, and changing them changes nothing."""
    q, k, v = torch.randn(1, 8, 5, 16), torch.randn(1, 8, 7, 16), torch.randn(1, 8, 7, 16)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[:, 4:] = False
    _, w = attnkit.attention(q, k, v, mask=mask, return_weights=True)
    assert (w[..., 4:] == 0).all()
    k2, v2 = k.clone(), v.clone()
    k2[..., 4:, :] = 1e4
    v2[..., 4:, :] = -1e4
    close(attnkit.attention(q, k2, v2, mask=mask), attnkit.attention(q, k, v, mask=mask))
    # the seed's idiom is a no-op: masked_fill without assignment leaves the scores unchanged
    scores = torch.randn(5, 7)
    before = scores.clone()
    scores.masked_fill(~mask, 1e-9)
    assert torch.equal(scores, before)


def test_seed001_mask_expand_is_kept_per_head():
    """Seed 001 also drops ``mask.unsqueeze(1).expand(...)``; a [B, Lq, Lk] mask must reach all heads."""
    mha = attnkit.MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    mask3 = torch.rand(2, 5, 5) > 0.4
    mask3[..., 0] = True
    _, w = mha(x, mask=mask3, need_weights=True)
    assert ((w > 0) == mask3[:, None]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_seed003_004_minus_1e9_overflow_cannot_happen(dtype):
    """Seeds 003/004 fill masked scores with ``-1e9``: in float16 that value does not exist
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


def test_seed001_dropped_transpose_cannot_mix_positions():
    """Seed 001 writes ``atten.transpose(1, 2)`` without assigning it, then reshapes
    [B, H, L, D] straight to [B, L, H*D], mixing heads and positions. Ours keeps positions
    apart: in cross-attention, changing query token j leaves every other output row unchanged."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 8).eval()
    xq, xkv = torch.randn(1, 5, 32), torch.randn(1, 7, 32)
    out = mha(xq, xkv)
    xq2 = xq.clone()
    xq2[0, 2] += 3.0
    out2 = mha(xq2, xkv)
    unchanged = [0, 1, 3, 4]
    close(out2[0, unchanged], out[0, unchanged])
    assert not torch.allclose(out2[0, 2], out[0, 2])
    # the seed's bug, reproduced on our own per-head output, does mix positions
    q, k, v = mha.project_qkv(xq, xkv, xkv)
    heads = attnkit.attention(q, k, v)  # (B, H, L, D)
    wrong = heads.reshape(1, 5, -1)
    right = heads.transpose(1, 2).reshape(1, 5, -1)
    assert not torch.allclose(wrong, right)
    close(mha.out_proj(right), out)


def test_seed004_parameter_count_is_1048576():
    """Seed 004: 8 heads x 3 x 512 x 64 = 786,432 plus the 512 x 512 output projection is
    1,048,576 (it prints 1,032,192). Our module without biases has exactly that many."""
    mha = attnkit.MultiHeadAttention(512, 8, bias=False)
    assert 3 * 512 * 64 == 98_304
    assert sum(p.numel() for p in mha.parameters()) == 8 * 98_304 + 512 * 512 == 1_048_576


def test_seed003_mask_polarity_is_true_means_attend():
    """Seed 003's comment says 'when mask is True (or 0)' while its code masks where mask == 0:
    polarity confusion. attnkit has one polarity: True = may attend, and rejects 0/1 ints."""
    q, k, v = (torch.randn(1, 1, 2, 4) for _ in range(3))
    only_first = torch.tensor([[True, False], [True, False]])
    close(attnkit.attention(q, k, v, mask=only_first), v[..., :1, :].expand(1, 1, 2, 4))
    with pytest.raises(TypeError, match="bool"):
        attnkit.attention(q, k, v, mask=only_first.int())


def test_seed000_scaling_keeps_score_variance_near_one():
    """Seed 000 Q2.1: with unit-variance q and k, q.k has variance d_k; scaling by 1/sqrt(d_k)
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


def test_variable_used_before_it_is_assigned():
    """Tutorial code that masks the scores before computing them raises as written; computing the
    scores first (the fix) runs and gives attnkit's result."""

    def as_written(q, k, v, mask=None):
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # noqa: F821 -- the tutorial's order
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        return scores.softmax(-1) @ v

    def fixed(q, k, v, mask=None):
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    mask = masks.causal(5)
    with pytest.raises(UnboundLocalError):
        as_written(q, k, v, mask)
    close(fixed(q, k, v, mask), attnkit.attention(q, k, v, mask=mask))


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
