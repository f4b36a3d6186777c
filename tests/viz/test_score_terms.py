"""Score terms: their sums are the scores attnkit's reference backend computes (through its
weights, in float64), one query's terms are that query's row, bad input is named, and the figure
draws the terms, the scores beside them and a chosen key's terms."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import attnkit
from attnkit.analysis import score_terms
from attnkit.viz import score_terms_figure
from tests.support.tolerances import close


def qk(*, b=2, h=4, hkv=4, lq=5, lk=7, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g, dtype=dtype),
            torch.randn(b, hkv, lk, d, generator=g, dtype=dtype))


@pytest.mark.parametrize("hkv, scale", [(4, None), (2, None), (1, 0.3)])
def test_terms_sum_to_the_scores_behind_the_reference_weights(hkv, scale):
    q, k = qk(hkv=hkv)
    v = torch.randn(2, hkv, 7, 3, dtype=torch.float64)
    terms = score_terms(q, k, scale=scale)
    assert terms.shape == (2, 4, 5, 7, 8) and terms.dtype == torch.float64
    _, weights = attnkit.attention(q, k, v, scale=scale, return_weights=True, backend="reference")
    close(torch.softmax(terms.sum(-1), dim=-1), weights)
    # and the scores themselves, against the plain formula (key head h // (H / Hkv) for query head h)
    kx = k.repeat_interleave(4 // hkv, dim=1)
    s = scale if scale is not None else 1 / math.sqrt(8)
    close(terms.sum(-1), q @ kx.transpose(-2, -1) * s)
    # every term is one product, exactly
    assert terms[1, 3, 2, 6, 5] == q[1, 3, 2, 5] * kx[1, 3, 6, 5] * s


def test_one_query_is_its_row_and_negative_positions_count_from_the_end():
    q, k = qk()
    terms = score_terms(q, k)
    assert torch.equal(score_terms(q, k, query=2), terms[..., 2, :, :])
    assert torch.equal(score_terms(q, k, query=-1), terms[..., 4, :, :])
    assert torch.equal(score_terms(q[0, 0], k[0, 0], query=1), terms[0, 0, 1])


def test_float32_terms_sum_to_the_float64_scores():
    q, k = qk()
    close(score_terms(q.float(), k.float()).sum(-1), q @ k.transpose(-2, -1) / math.sqrt(8), torch.float32)


@pytest.mark.parametrize("q, k, kwargs, error, words", [
    ([[1.0]], torch.ones(1, 1), {}, TypeError, "q must be a torch.Tensor"),
    (torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3), {}, TypeError, "q must be a floating-point"),
    (torch.ones(3), torch.ones(2, 3), {}, ValueError, "q must be [..., L, D]"),
    (torch.ones(1, 2, 3), torch.ones(2, 3), {}, ValueError, "same number of dimensions"),
    (torch.ones(2, 3), torch.ones(2, 4), {}, ValueError, "head size D"),
    (torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64), {}, TypeError, "same dtype"),
    (torch.ones(3, 2, 4), torch.ones(2, 2, 4), {}, ValueError, "multiple of the key heads"),
    (torch.ones(3, 2, 2, 4), torch.ones(2, 2, 2, 4), {}, ValueError, "do not broadcast"),
    (torch.ones(2, 3), torch.ones(2, 3), {"scale": "0.5"}, TypeError, "scale must be a real number"),
    (torch.ones(2, 3), torch.ones(2, 3), {"scale": math.inf}, ValueError, "scale must be finite"),
    (torch.ones(2, 3), torch.ones(2, 3), {"query": 2}, ValueError, "query must be in [-2, 2)"),
    (torch.ones(2, 3), torch.ones(2, 3), {"query": 1.0}, TypeError, "query must be an int"),
])
def test_bad_input_is_named(q, k, kwargs, error, words):
    with pytest.raises(error, match=re.escape(words)):
        score_terms(q, k, **kwargs)


def test_figure_draws_terms_scores_and_the_chosen_key():
    q, k = qk(lq=3, lk=6, d=10)
    q, k = q[0, 1], k[0, 1]
    tokens = ["the", "river", "bank", "was", "eroding", "."]
    fig = score_terms_figure(q, k, query=2, key=1, q_tokens=["a", "b", "c"], k_tokens=tokens)
    terms = score_terms(q, k, query=2).numpy()
    heat, bars, colorbar, one = fig.axes
    image = heat.get_images()[0]
    np.testing.assert_array_equal(image.get_array(), terms)
    lo, hi = image.get_clim()
    assert lo == -hi == -np.abs(terms).max()  # centred at 0: a colour says a term's sign
    assert image.get_cmap().name == "RdBu_r"
    widths = [p.get_width() for p in bars.patches]
    np.testing.assert_allclose(widths, terms.sum(-1), rtol=1e-12)
    np.testing.assert_allclose([p.get_height() for p in one.patches], terms[1], rtol=1e-12)
    assert [t.get_text() for t in heat.get_yticklabels()] == tokens
    assert "key river" in one.get_title() and fig.get_suptitle() == "score terms of query c, key river"
    fig.canvas.draw()  # renders with Agg
    assert len(score_terms_figure(q, k, query=0).axes) == 3  # no key: no bar chart under the map


@pytest.mark.parametrize("kwargs, words", [
    ({"query": 0, "key": 6}, "key must be in [-6, 6)"),
    ({"query": 3}, "query must be in [-3, 3)"),
    ({"query": 0, "k_tokens": ["a"]}, "k_tokens has 1 tokens"),
    ({"query": 0, "q_tokens": ["a"]}, "q_tokens has 1 tokens"),
])
def test_figure_bad_input_is_named(kwargs, words):
    q, k = qk(lq=3, lk=6)
    with pytest.raises(ValueError, match=re.escape(words)):
        score_terms_figure(q[0, 0], k[0, 0], **kwargs)
    with pytest.raises(ValueError, match=r"q must be \[L, D\] for one head"):
        score_terms_figure(q, k[0, 0], query=0)
