"""attnkit.analysis.recorded_weights: the weights of a model's own forward pass, the model unchanged."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.analysis import recorded_weights
from tests.support.tolerances import close


def _mha():
    torch.manual_seed(0)
    return attnkit.MultiHeadAttention(16, 4, dtype=torch.float64).eval()


def test_weights_are_those_of_the_forward_pass_and_the_output_is_unchanged():
    mha, x = _mha(), torch.randn(2, 5, 16, dtype=torch.float64)
    plain = mha(x, is_causal=True)
    out_ref, w_ref = mha(x, is_causal=True, need_weights=True)
    with recorded_weights([mha]) as rec:
        out = mha(x, is_causal=True)
        mha(x[:, :3], is_causal=True)
    close(out, plain)  # float64: the reference backend's rounding is far below the table's row
    assert [w.shape for w in rec[0]] == [(2, 4, 5, 5), (2, 4, 3, 3)]
    close(rec[0][0], w_ref)
    assert torch.equal(rec[0][0].triu(1), torch.zeros_like(rec[0][0]))  # causal: nothing above the diagonal
    assert torch.equal(mha(x, is_causal=True), plain)  # hooks removed


def test_a_caller_that_asks_for_the_weights_still_gets_them():
    mha, x = _mha(), torch.randn(1, 4, 16, dtype=torch.float64)
    with recorded_weights([mha]) as rec:
        out, w = mha(x, need_weights=True)
    assert torch.equal(w, rec[0][0]) and out.shape == (1, 4, 16)


def test_hooks_are_removed_on_error_and_foreign_modules_refused():
    mha = _mha()
    with pytest.raises(RuntimeError), recorded_weights([mha]):
        raise RuntimeError("boom")
    assert not mha._forward_hooks and not mha._forward_pre_hooks
    with pytest.raises(TypeError, match="MultiHeadAttention"), recorded_weights([torch.nn.MultiheadAttention(16, 4)]):
        pass
