"""The "flex" backend on CPU, the heavier cases: each compiles a kernel of its own (several seconds).

A dense mask whose rows are many runs of keys (read cell by cell, not through intervals), a
``score_mod`` with no mask (no BlockMask at all), a ``mask_mod`` written per element that compiled
Flex miscomputes (the first call's check finds it) and the same mask written so that it does not,
and a mod TorchDynamo cannot trace (in both failures the next backend serves, and ``which_backend``
then gives the reason). See ``test_flex.py`` for the rest of the grid.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import attnkit
from attnkit.backends import flex
from tests.backends.test_flex import SMALL, E, H, L, block_pattern, expected, forward, qkv
from tests.support.tolerances import close

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

IMAGES = torch.tensor([[0, 30], [30, 55], [55, L]])
IMAGE_OF = torch.tensor([0] * 25 + [1] * 30 + [2] * (L - 55))


def flamingo(b, h, q_idx, kv_idx):
    """Written per element, as FlexAttention calls a mod: each query sees its image's keys."""
    interval = IMAGES[IMAGE_OF[q_idx]]
    return (kv_idx >= interval[0]) & (kv_idx < interval[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_dense_mask_of_many_runs_a_row_matches_the_oracle(dtype):
    q, k, v = qkv(dtype=dtype)
    dense = block_pattern()
    dense[1, 0, 3] = False  # and a row with nothing to attend
    with torch.no_grad():
        assert flex._mask_function(attnkit.call.validate_call(q, k, v, mask=dense))[2] == "a dense mask"
    out = forward(SMALL, q, k, v, mask=dense)
    close(out, expected(q, k, v, allowed=dense), dtype)
    assert torch.equal(out[1, :, 3], torch.zeros(H, E, dtype=dtype))


def test_a_score_mod_without_a_mask_matches_the_oracle():
    table = torch.randn(H, 2 * L - 1, generator=torch.Generator().manual_seed(4))

    def relative(s, b, h, q_idx, kv_idx):  # a user's own relative-position table
        return s + table[h, kv_idx - q_idx + L - 1]

    q, k, v = qkv()
    out = forward(SMALL, q, k, v, score_mod=relative, scale=0.3)
    close(out, expected(q, k, v, score_mod=relative, scale=0.3), torch.float32)


def test_a_mod_compiled_flex_miscomputes_is_caught_by_the_first_call_check_and_served_by_the_next_backend(capfd):
    """PyTorch 2.13's compiled Flex on the CPU gets ``row = table[ids[q_idx]]; row[0]`` wrong (with its
    own ``create_block_mask`` too): the first call's check against the formula finds it."""
    q, k, v = qkv()
    out = forward(SMALL, q, k, v, mask_mod=flamingo)
    allowed = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        lo, hi = IMAGES[IMAGE_OF[i]].tolist()
        allowed[i, lo:hi] = True
    close(out, expected(q, k, v, allowed=allowed), torch.float32)
    err = capfd.readouterr().err
    assert "compiled flex_attention cannot serve this call (ValueError: the compiled kernel disagrees" in err

    def flamingo_flat(b, h, q_idx, kv_idx):  # the same mask, read without the row in between: Flex gets it right
        return (kv_idx >= IMAGES[IMAGE_OF[q_idx], 0]) & (kv_idx < IMAGES[IMAGE_OF[q_idx], 1])

    out = forward(SMALL, q, k, v, mask_mod=flamingo_flat)
    close(out, expected(q, k, v, allowed=allowed), torch.float32)
    assert "cannot serve" not in capfd.readouterr().err


def test_a_mod_dynamo_cannot_trace_is_served_by_the_next_backend_and_then_refused_with_the_reason(capfd):
    def graph_break(b, h, q_idx, kv_idx):
        torch._dynamo.graph_break()
        return kv_idx <= q_idx

    q, k, v = qkv(lq=33, lk=33)
    out = forward(SMALL, q, k, v, mask_mod=graph_break)
    close(out, expected(q, k, v, is_causal=True), torch.float32)
    assert "compiled flex_attention cannot serve this call (Unsupported: " in capfd.readouterr().err
    with torch.no_grad():
        req = attnkit.call.validate_call(q, k, v, mask_mod=graph_break)
        assert SMALL.not_supported_reasons(req)[0].startswith(
            "compiled flex_attention cannot serve this family of calls: Unsupported: ")
