"""The "flex" backend on CPU when compiled Flex fails: a mod it gets wrong (the first call's check
against the formula finds it; a compile of several seconds) and a mod TorchDynamo cannot trace. In
both the next backend serves, and ``which_backend`` then gives the reason. See ``test_flex.py`` for
the grid.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import attnkit
from tests.backends.test_flex import SMALL, L, expected, forward, qkv
from tests.support.tolerances import close

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

IMAGES = torch.tensor([[0, 30], [30, 55], [55, L]])
IMAGE_OF = torch.tensor([0] * 25 + [1] * 30 + [2] * (L - 55))


def flamingo(b, h, q_idx, kv_idx):
    """Written per element, as FlexAttention calls a mod: each query sees its image's keys."""
    interval = IMAGES[IMAGE_OF[q_idx]]
    return (kv_idx >= interval[0]) & (kv_idx < interval[1])


def test_a_mod_compiled_flex_miscomputes_is_caught_by_the_first_call_check_and_served_by_the_next_backend(capfd):
    """PyTorch 2.13's compiled Flex on the CPU gets ``row = table[ids[q_idx]]; row[0]`` wrong (with its
    own ``create_block_mask`` too): the first call's check against the formula finds it."""
    q, k, v = qkv()
    out = forward(SMALL, q, k, v, mask_mod=flamingo, falls_back=True)
    allowed = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        lo, hi = IMAGES[IMAGE_OF[i]].tolist()
        allowed[i, lo:hi] = True
    close(out, expected(q, k, v, allowed=allowed), torch.float32)
    err = capfd.readouterr().err
    assert "compiled flex_attention cannot serve this call (ValueError: the compiled kernel disagrees" in err
    with torch.no_grad():
        req = attnkit.call.validate_call(q, k, v, mask_mod=flamingo)
        assert "the compiled kernel disagrees with the formula" in SMALL.not_supported_reasons(req)[0]


def test_a_mod_dynamo_cannot_trace_is_served_by_the_next_backend_and_then_refused_with_the_reason(capfd):
    def graph_break(b, h, q_idx, kv_idx):
        torch._dynamo.graph_break()
        return kv_idx <= q_idx

    q, k, v = qkv(lq=33, lk=33)
    out = forward(SMALL, q, k, v, mask_mod=graph_break, falls_back=True)
    close(out, expected(q, k, v, is_causal=True), torch.float32)
    assert "compiled flex_attention cannot serve this call (Unsupported: " in capfd.readouterr().err
    with torch.no_grad():
        req = attnkit.call.validate_call(q, k, v, mask_mod=graph_break)
        assert SMALL.not_supported_reasons(req)[0].startswith(
            "compiled flex_attention cannot serve this family of calls: Unsupported: ")
