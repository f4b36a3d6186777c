"""score_mods written by hand reach the banded kernel when they add a bias per head and diagonal,
and only then: scores.diagonal_bias probes them and checks what it found against the mod."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import scores
from tests.support.tolerances import PARITY, close

H = 4


def hand_written(slopes: torch.Tensor, table: torch.Tensor, buckets: torch.Tensor):
    """Biases per head and diagonal, written as users write them (no attnkit helper)."""

    def alibi_causal(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def alibi_symmetric(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, (kv_idx - q_idx).clamp(-5, 5) + 5]

    def t5_buckets(score, b, h, q_idx, kv_idx):
        rel = kv_idx - q_idx
        bucket = torch.where(rel.abs() < 4, rel + 8, torch.where(rel > 0, 15, 0))
        return score + buckets[bucket, h]

    return [alibi_causal, alibi_symmetric, relative, t5_buckets]


def not_diagonal(batch_bias: torch.Tensor):
    counter = [0]

    def counting(score, b, h, q_idx, kv_idx):  # a global counter: a different bias on every call
        counter[0] += 1
        return score + counter[0]

    def product(score, b, h, q_idx, kv_idx):  # a bias, but not a function of kv - q
        return score + 1e-3 * (q_idx * kv_idx)

    def per_batch(score, b, h, q_idx, kv_idx):  # depends on the batch element
        return score + batch_bias[b] * (kv_idx - q_idx)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * 1.5

    def noisy(score, b, h, q_idx, kv_idx):
        return score + torch.rand(score.shape, dtype=score.dtype)

    def far_corner(score, b, h, q_idx, kv_idx):  # diagonal but for the grid's last row
        return score - 0.1 * (q_idx - kv_idx).abs() + 3.0 * (q_idx == 59)

    return [counting, product, per_batch, scaled, noisy, far_corner]


@settings(deadline=None, max_examples=15)
@given(lq=st.integers(1, 60), extra=st.integers(0, 9), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_hand_written_diagonal_biases_run_on_the_band_exactly(lq, extra, causal, seed):
    g = torch.Generator().manual_seed(seed)
    slopes = torch.rand(H, generator=g, dtype=torch.float64).requires_grad_()
    table = torch.randn(H, 11, generator=g, dtype=torch.float64).requires_grad_()
    buckets = torch.randn(16, H, generator=g, dtype=torch.float64)
    lk = lq + extra
    q = torch.randn(2, H, lq, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, lk, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    for mod in hand_written(slopes, table, buckets):
        kw = {"score_mod": mod, "is_causal": causal}
        assert attnkit.which_backend(q, k, v, **kw) == "band", mod.__name__
        out = attnkit.attention(q, k, v, **kw)
        want = attnkit.attention(q, k, v, backend="reference", **kw)
        close(out, want)
        dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
        leaves = (q, k, v, slopes, table)
        got = torch.autograd.grad(out, leaves, dout, allow_unused=True)
        ref = torch.autograd.grad(want, leaves, dout, allow_unused=True)
        for a, b in zip(got, ref, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                close(a, b)


def test_mods_that_only_look_diagonal_are_refused_and_served_by_the_tiles():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 60, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for mod in not_diagonal(torch.tensor([0.5, -0.5], dtype=torch.float64)):
        assert scores.diagonal_bias(mod, batch=2, heads=H, q_len=60, kv_len=60, dtype=torch.float64) is None, \
            mod.__name__
        assert attnkit.which_backend(q, k, v, score_mod=mod) == "tiles", mod.__name__
        if mod.__name__ not in ("counting", "noisy"):
            close(attnkit.attention(q, k, v, score_mod=mod), attnkit.attention(q, k, v, score_mod=mod,
                                                                                backend="reference"))


def test_the_table_is_the_bias_of_each_diagonal():
    slopes = torch.tensor([1.0, 0.5])
    got = scores.diagonal_bias(lambda s, b, h, i, j: s + slopes[h] * (j - i), batch=1, heads=2, q_len=3, kv_len=4,
                               dtype=torch.float64)
    d = torch.arange(-2, 4, dtype=torch.float64)  # kv - q of columns 0 .. Lq + Lk - 2
    assert got.dtype == torch.float64 and torch.equal(got, torch.stack([d, 0.5 * d]))


def test_the_library_helpers_keep_their_exact_tables():
    slopes = scores.alibi_slopes(H)
    helper = scores.alibi(slopes)
    table = scores.diagonal_bias(helper, batch=1, heads=H, q_len=5, kv_len=5, dtype=torch.float32)
    assert torch.equal(table, helper.diagonal(H, 5, 5, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_float64_tables(dtype):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, H, 33, 16, generator=g).to(dtype) for _ in range(3))
    slopes = torch.rand(H, generator=g)  # float32 slopes with either input dtype
    mod = lambda s, b, h, i, j: s - slopes[h] * (i - j).abs()  # noqa: E731
    assert attnkit.which_backend(q, k, v, score_mod=mod) == "band"
    close(attnkit.attention(q, k, v, score_mod=mod), attnkit.attention(q, k, v, score_mod=mod, backend="reference"),
          dtype)


def hand_written_caps():
    """Gemma 2's attn_logit_softcapping, as users write it."""

    def gemma(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / 30.0) * 30.0

    def divided(score, b, h, q_idx, kv_idx):
        cap = 50.0
        return cap * (score / cap).tanh()

    return [(gemma, 30.0), (divided, 50.0)]


@pytest.mark.parametrize("mod, cap", hand_written_caps())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hand_written_soft_caps_run_on_the_band_exactly(mod, cap, dtype):
    """Against the float64 oracle on the same (rounded) inputs, outputs and gradients."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, H, 40, 8, generator=g, dtype=torch.float64).mul(6).to(dtype).requires_grad_()
               for _ in range(3))  # scores up to a few hundred: the cap saturates
    assert scores.soft_cap(mod, batch=2, heads=H, q_len=40, kv_len=40, dtype=dtype) == cap
    kw = {"score_mod": mod, "is_causal": True}
    assert attnkit.which_backend(q, k, v, **kw) == "band"
    out = attnkit.attention(q, k, v, **kw)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = attnkit.attention(*exact, backend="reference", **kw)
    close(out, want, dtype, **PARITY[dtype])
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout.to(dtype)), torch.autograd.grad(want, exact, dout),
                    strict=True):
        close(a, b, dtype, **PARITY[dtype])


def test_mods_that_only_look_capped_are_refused():
    learned = torch.tensor(30.0, requires_grad=True)
    lookalikes = {
        "hard clamp": lambda s, b, h, i, j: s.clamp(-30.0, 30.0),
        "cap and scale disagree": lambda s, b, h, i, j: 29.9 * torch.tanh(s / 30.0),
        "cap plus an index term": lambda s, b, h, i, j: 30.0 * torch.tanh(s / 30.0) + 1e-3 * i,
        "learned cap": lambda s, b, h, i, j: learned * torch.tanh(s / learned),
        "per head": lambda s, b, h, i, j: (30.0 + h) * torch.tanh(s / (30.0 + h)),
    }
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, 24, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for name, mod in lookalikes.items():
        assert scores.soft_cap(mod, batch=1, heads=H, q_len=24, kv_len=24, dtype=torch.float64) is None, name
        assert attnkit.which_backend(q, k, v, score_mod=mod) == "tiles", name
        close(attnkit.attention(q, k, v, score_mod=mod), attnkit.attention(q, k, v, score_mod=mod,
                                                                            backend="reference"))
