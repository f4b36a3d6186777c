"""The "flex" backend on CPU over the generic grid's axes, and when compiled Flex fails.

The grid: what ``tests/core/test_attention.py`` checks of the other backends (which it runs without
flex: a compile per case), on one shape that has them all at once (GQA, ``Lq > Lk`` so that causal
rows above the keys are dead, odd lengths, an odd head dim, ``Ev != E``, a key block cut short), each
case in float32, bfloat16 and float16 (all computed in float32 on the CPU, so they share kernels):
two compiled kernels, the plan's intervals (padding, a window mask, a dead row) and the band with a
user's ``mask_mod`` and ``score_mod``. The failures: a mod compiled Flex gets wrong (the first
call's check against the formula finds it; a compile of several seconds) and a mod TorchDynamo
cannot trace. In both the next backend serves, and ``which_backend`` then gives the reason. And
PyTorch's own CPU Flex reading keys past the end of ``k`` (why ``flex.CPU_MIN_HEAD_DIM`` exists).
See ``test_flex.py`` for the BlockMask, the refusals and the kernels of the square shape.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import attnkit
from attnkit import masks
from attnkit.backends import flex
from tests.backends.test_flex import SMALL, L, expected, followed_by_nan, forward, qkv
from tests.support import oracle
from tests.support.tolerances import close

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

IMAGES = torch.tensor([[0, 30], [30, 55], [55, L]])
IMAGE_OF = torch.tensor([0] * 25 + [1] * 30 + [2] * (L - 55))


def flamingo(b, h, q_idx, kv_idx):
    """Written per element, as FlexAttention calls a mod: each query sees its image's keys."""
    interval = IMAGES[IMAGE_OF[q_idx]]
    return (kv_idx >= interval[0]) & (kv_idx < interval[1])


def test_a_mod_compiled_flex_miscomputes_is_caught_by_the_first_call_check_and_served_by_the_next_backend(said):
    """PyTorch 2.13's compiled Flex on the CPU gets ``row = table[ids[q_idx]]; row[0]`` wrong (with its
    own ``create_block_mask`` too): the first call's check against the formula finds it."""
    q, k, v = qkv()
    out = forward(SMALL, q, k, v, mask_mod=flamingo, falls_back=True)
    allowed = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        lo, hi = IMAGES[IMAGE_OF[i]].tolist()
        allowed[i, lo:hi] = True
    close(out, expected(q, k, v, allowed=allowed), torch.float32)
    err = said()
    assert "compiled flex_attention cannot serve this call (ValueError: the compiled kernel disagrees" in err
    with torch.no_grad():
        req = attnkit.call.validate_call(q, k, v, mask_mod=flamingo)
        assert "the compiled kernel disagrees with the formula" in SMALL.not_supported_reasons(req)[0]


def test_a_mod_dynamo_cannot_trace_is_served_by_the_next_backend_and_then_refused_with_the_reason(said):
    def graph_break(b, h, q_idx, kv_idx):
        torch._dynamo.graph_break()
        return kv_idx <= q_idx

    q, k, v = qkv(lq=33, lk=33)
    out = forward(SMALL, q, k, v, mask_mod=graph_break, falls_back=True)
    close(out, expected(q, k, v, is_causal=True), torch.float32)
    assert "compiled flex_attention cannot serve this call (Unsupported: " in said()
    with torch.no_grad():
        req = attnkit.call.validate_call(q, k, v, mask_mod=graph_break)
        assert SMALL.not_supported_reasons(req)[0].startswith(
            "compiled flex_attention cannot serve this family of calls: Unsupported: ")


# --------------------------------------------------------------------------------------------
# The generic grid's axes on one shape (compiled: two kernels, shared by the cases and dtypes)
# --------------------------------------------------------------------------------------------

#: (B, H, Hkv, Lq, Lk, E, Ev): GQA, Lq > Lk (causal rows 0..12 see no key), odd lengths and head dim,
#: Ev != E; at SMALL's block of 16 the keys end in a block of 8.
GRID = (2, 4, 2, 37, 24, 7, 5)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def grid_qkv(dtype):
    b, h, hkv, lq, lk, e, ev = GRID
    g = torch.Generator().manual_seed(5)
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
            for shape in ((b, h, lq, e), (b, hkv, lk, e), (b, hkv, lk, ev))]


def stripes(b, h, q_idx, kv_idx):
    """A user's mask_mod: irregular, per head, and it empties query row 30."""
    return ((q_idx * 3 + kv_idx + h) % 4 != 0) & (q_idx != 30)


def alibi_like(score, b, h, q_idx, kv_idx):
    return score - 0.25 * (h + 1) * (q_idx - kv_idx).abs()


def per_batch(mask):
    b, h, _, lq, lk, _, _ = GRID
    return mask.expand(b, 1, lq, lk).clone()


def padding():
    lengths = torch.tensor([GRID[4], 11])
    return per_batch(torch.arange(GRID[4]) < lengths.view(-1, 1, 1, 1))


def window_and_a_dead_row():
    m = masks.sliding_window(GRID[3], GRID[4], left=3, right=1)
    m[20] = False
    return per_batch(m)


#: Dense masks of one interval a row, per batch element: one kernel (the plan's intervals).
DENSE = {
    "padding": lambda: {"mask": padding()},
    "padding, causal": lambda: {"mask": padding(), "is_causal": True},
    "window mask, dead row": lambda: {"mask": window_and_a_dead_row()},
}
#: The band with a user's mask_mod and score_mod: one kernel.
MODS = {
    "causal": {"is_causal": True},
    "window": {"window": (2, 1)},
    "causal window": {"is_causal": True, "window": (4, None)},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [*DENSE, *(f"{name}, mask_mod, score_mod" for name in MODS)])
def test_the_generic_grid_on_one_shape_matches_the_oracle_and_dead_rows_are_zero(case, dtype):
    q, k, v = grid_qkv(dtype)
    b, h, _, lq, lk, _, _ = GRID
    if case in DENSE:
        kw = DENSE[case]()
        allowed = kw["mask"].expand(b, h, lq, lk)
        if kw.get("is_causal"):
            allowed = allowed & oracle.allowed_grid(b, h, lq, lk, is_causal=True)
        score_mod = None
    else:
        kw = {**MODS[case.split(",")[0]], "mask_mod": stripes}
        allowed = oracle.allowed_grid(b, h, lq, lk, **kw)
        score_mod = alibi_like
    out = forward(SMALL, q, k, v, score_mod=score_mod, **kw)
    assert out.dtype == dtype and out.shape == (b, h, lq, GRID[6])
    want = expected(q, k, v, allowed=allowed, score_mod=score_mod)
    close(out, want, dtype)
    dead = ~allowed.any(-1)
    assert bool(dead.any()) == (case != "padding")  # every other case has rows that see no key
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))


# --------------------------------------------------------------------------------------------
# PyTorch's own CPU Flex at a small head dim (why flex.CPU_MIN_HEAD_DIM exists)
# --------------------------------------------------------------------------------------------


def test_pytorch_cpu_flex_reads_keys_past_the_end_of_k_at_small_head_dims():
    """PyTorch 2.13's compiled ``flex_attention`` on the CPU, without attnkit: head dim 16, as many keys
    as the float vector's width (the last tile of keys; 8 under AVX2), ``k`` followed by NaN in memory.
    The scores of keys past ``k`` land on the running maxima of the first rows (9 rows: no further): the
    last (batch element, head) comes out NaN there, the others (which read the next head's keys, finite)
    are right. When this test fails,
    PyTorch reads no key past ``k`` any more, and ``flex.CPU_MIN_HEAD_DIM`` (zero columns up to head dim
    24) can go."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch.nn.attention.flex_attention import flex_attention

    width = pick_vec_isa().nelements(torch.float) if pick_vec_isa() else 0
    if not 0 < width < 16:
        pytest.skip(f"no tail of keys that is a multiple of a {width}-float vector and short of 16")
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g) for n in (9, width, width))
    k = followed_by_nan(k)
    assert k.shape[-1] < flex.CPU_MIN_HEAD_DIM
    out = torch.compile(flex_attention, dynamic=False, fullgraph=True)(q, k, v)
    want = expected(q, k, v)
    assert bool(out[-1, -1].isnan().any())
    close(out[:, :-1], want[:, :-1], torch.float32)
    close(out[0, -1], want[0, -1], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_decode_step_one_query_over_many_keys_matches_the_oracle(dtype):
    """A decode step's shape, ``Lq = 1`` over ``Lk = 600`` keys (FlexAttention takes a path of its own for
    so few queries): causal aligned bottom-right (every key) and a window over the last 100 keys, both
    through the registered backend, against the float64 oracle."""
    q, k, v = qkv(lq=1, lk=600, dtype=dtype)
    backend = attnkit.backends.get("flex")
    for kw in ({"is_causal": True}, {"window": (100, 0)}):
        out = forward(backend, q, k, v, **kw)
        close(out, expected(q.double(), k.double(), v.double(), **kw), dtype)
