"""Rollout against a hand-computed two-layer example, head statistics, and the complexity
calculator against hand-computed figures and real modules' parameter counts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit import MultiHeadAttention
from attnkit.analysis import (
    attention_cost,
    compare_heads,
    entropy,
    fuse_heads,
    mean_distance,
    projection_params,
    rollout,
)
from attnkit.bench._util import attention_flops
from tests.support.tolerances import close

# Two layers, two heads, two tokens, batch 1: [B, H, L, L] per layer.
LAYER1 = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]]]], dtype=torch.float64)
LAYER2 = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)


def t(rows):
    return torch.tensor([rows], dtype=torch.float64)


# Worked by hand (see the comments) with A' = 0.5 A + 0.5 I, rows renormalised, R = A2' A1'.
@pytest.mark.parametrize("fusion, residual, expected", [
    # mean: A1 = [[.5,.5],[.5,.5]] -> [[.75,.25],[.25,.75]]; A2 = [[1,0],[.5,.5]] -> [[1,0],[.25,.75]]
    ("mean", 0.5, [[0.75, 0.25], [0.375, 0.625]]),
    # max: A1 = [[1,1],[.5,.5]] -> [[1,.5],[.25,.75]] -> [[2/3,1/3],[.25,.75]];
    #      A2 = [[1,0],[1,1]] -> [[1,0],[.5,1]] -> [[1,0],[1/3,2/3]]
    ("max", 0.5, [[2 / 3, 1 / 3], [7 / 18, 11 / 18]]),
    # min: A1 = [[0,0],[.5,.5]] -> [[.5,0],[.25,.75]] -> [[1,0],[.25,.75]]; A2 = [[1,0],[0,0]] -> I
    ("min", 0.5, [[1.0, 0.0], [0.25, 0.75]]),
    # no residual: [[1,0],[.5,.5]] @ [[.5,.5],[.5,.5]]
    ("mean", 0.0, [[0.5, 0.5], [0.5, 0.5]]),
])
def test_rollout_two_layers_by_hand(fusion, residual, expected):
    got = rollout([LAYER1, LAYER2], head_fusion=fusion, residual=residual)
    assert got.shape == (1, 2, 2) and got.dtype == torch.float64
    close(got, t(expected))
    close(rollout(torch.stack([LAYER1, LAYER2]), head_fusion=fusion, residual=residual), t(expected))


def test_rollout_order_matters_and_one_layer_is_its_own_rollout():
    # Swapping the layers gives A1' A2' = [[.75,.25],[.25,.75]] @ [[1,0],[.25,.75]], a different product.
    close(rollout([LAYER2, LAYER1]), t([[0.8125, 0.1875], [0.4375, 0.5625]]))
    close(rollout([LAYER1], residual=1.0), t([[1.0, 0.0], [0.0, 1.0]]))


@given(layers=st.integers(1, 4), heads=st.integers(1, 3), n=st.integers(1, 6),
       fusion=st.sampled_from(["mean", "max", "min"]), residual=st.floats(0.0, 1.0), seed=st.integers(0, 99))
def test_rollout_rows_are_distributions(layers, heads, n, fusion, residual, seed):
    g = torch.Generator().manual_seed(seed)
    att = [torch.softmax(torch.randn(2, heads, n, n, generator=g, dtype=torch.float64), -1) for _ in range(layers)]
    r = rollout(att, head_fusion=fusion, residual=residual)
    assert (r >= 0).all()
    close(r.sum(-1), torch.ones(2, n, dtype=torch.float64))


def test_rollout_and_fusion_reject_bad_input():
    with pytest.raises(ValueError, match="head_fusion"):
        rollout([LAYER1], head_fusion="median")
    with pytest.raises(ValueError, match="residual"):
        rollout([LAYER1], residual=1.5)
    with pytest.raises(ValueError, match="at least one layer"):
        rollout([])
    with pytest.raises(ValueError, match="expected"):
        rollout([LAYER1, torch.ones(1, 2, 3, 3)])
    with pytest.raises(ValueError, match=r"\[B, H, L, L\]"):
        fuse_heads(torch.ones(2, 2, 2))


def test_fully_masked_row_stays_zero_without_residual():
    a = LAYER1.clone()
    a[0, :, 1] = 0.0
    r = rollout([a], residual=0.0)
    assert torch.equal(r[0, 1], torch.zeros(2, dtype=torch.float64))
    close(r[0, 0], torch.tensor([0.5, 0.5], dtype=torch.float64))


def test_entropy_and_distance_by_hand():
    uniform = torch.full((4, 4), 0.25, dtype=torch.float64)
    close(entropy(uniform), torch.tensor(2.0, dtype=torch.float64))
    close(entropy(torch.eye(4, dtype=torch.float64)), torch.tensor(0.0, dtype=torch.float64))
    prev = torch.zeros(4, 4, dtype=torch.float64)
    prev[0, 0] = 1.0
    prev[1:, :-1] = torch.eye(3, dtype=torch.float64)
    close(mean_distance(prev), torch.tensor(3 / 4, dtype=torch.float64))
    # uniform over 4: mean |i-j| over all pairs = (0+1+2+3 + 1+0+1+2 + 2+1+0+1 + 3+2+1+0) / 16 = 20 / 16
    close(mean_distance(uniform), torch.tensor(20 / 16, dtype=torch.float64))
    # A fully masked row is left out of the mean.
    masked = uniform.clone()
    masked[2] = 0.0
    close(entropy(masked), torch.tensor(2.0, dtype=torch.float64))
    # Lq != Lk: the one query sits at the last key (bottom-right); it looks at key 0, 3 tokens back.
    close(mean_distance(torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)),
          torch.tensor(3.0, dtype=torch.float64))
    assert entropy(torch.softmax(torch.randn(2, 3, 5, 5), -1)).shape == (2, 3)


def test_cost_matches_hand_computed_figures():
    c = attention_cost(512, 512, 8)
    assert c.head_dim == 64
    assert c.projection_flops == 4 * 2 * 512 * 512 * 512 == 1_073_741_824
    assert c.attention_flops == 4 * 512 * 512 * 512 == 536_870_912
    assert c.attention_flops == attention_flops(512, 512, 64, 8)  # the benchmarks' convention
    assert c.score_elements == 8 * 512 * 512 == 2_097_152
    assert c.score_bytes == 2_097_152 * 4 == 8 * 2**20
    assert c.peak_attention_bytes == 2 * 8 * 2**20  # the reference keeps scores and weights
    assert c.params == 1_048_576
    causal = attention_cost(512, 512, 8, causal=True, layers=6, batch=2, dtype="bfloat16", backend="naive")
    assert causal.attention_flops == 536_870_912 / 2 * 6 * 2
    assert causal.projection_flops == 1_073_741_824 * 6 * 2
    assert causal.score_bytes == 2 * 8 * 512 * 512 * 2 == causal.peak_attention_bytes
    assert causal.params == 6 * 1_048_576
    tiled = attention_cost(4096, 512, 8, backend="sdpa", block=128)
    assert tiled.score_elements == 8 * 4096 * 4096
    assert tiled.peak_attention_bytes == 8 * (128 * 128 * 4 + 2 * 4096 * 4)
    assert math.isclose(tiled.total_flops, tiled.projection_flops + tiled.attention_flops)
    assert any("1,048,576" in v for _, v in c.rows())


def test_parameter_counts_match_real_modules():
    def count(m):
        return sum(p.numel() for p in m.parameters())

    for d, h in ((512, 8), (384, 12), (64, 1)):
        assert projection_params(d, h) == count(torch.nn.MultiheadAttention(d, h, bias=False))
        assert projection_params(d, h, bias=True) == count(torch.nn.MultiheadAttention(d, h))
        assert projection_params(d, h) == count(MultiHeadAttention(d, h, bias=False))
    assert projection_params(512, 8) == projection_params(512, 1) == 8 * 98_304 + 512 * 512 == 1_048_576
    assert projection_params(512, 1, out_proj=False) == 786_432


def test_seed_004_comparison_prints_the_correct_total_and_the_slip():
    text = "\n".join(compare_heads(512, 8, n=128))
    assert "3 x 512 x 64 = 98,304" in text
    assert "786,432 + 262,144 = 1,048,576" in text
    assert "1,032,192" in text and "16,384 short" in text
    assert "FLOPs are the same" in text
    assert "1,032,192" not in "\n".join(compare_heads(384, 12))


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 0, "d": 512, "heads": 8}, "n must be a positive integer"),
    ({"n": 8, "d": 510, "heads": 8}, r"d \(510\) must be divisible by heads \(8\)"),
    ({"n": 8, "d": 512, "heads": 8, "dtype": "int8"}, "dtype must be one of"),
    ({"n": 8, "d": 512, "heads": 8, "backend": "fast"}, "backend must be one of"),
    ({"n": 8, "d": 512, "heads": True}, "heads must be a positive integer"),
])
def test_cost_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        attention_cost(**kwargs)
