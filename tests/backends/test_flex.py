"""The "flex" backend on CPU: its BlockMask against the plan, its refusals, and its forward against the oracle.

PyTorch 2.13's FlexAttention runs forward only on the CPU, in float32, bfloat16 and float16, and
each new family (shapes, dtype, mods) costs a compile of several seconds: every compiled case here
shares one shape (``B, H, L, E``) and one block size (``BLOCK``, small, so that ``L`` spans empty,
full and partial blocks), and half types are computed in float32 on the CPU, so bfloat16 reuses
the float32 kernels. Four kernels in all: the band (``is_causal``/``window``), the band with a
user's ``mask_mod`` and a ``score_mod``, the plan's intervals (a dense mask, a ``MaskPlan``), and,
through the registered backend at Flex's default block size, a ``score_mod`` without a mask with
GQA and ``Lq != Lk`` (with ``k`` followed by NaN too: no key past its end may reach the output).
The mask functions of the other paths (a dense mask of many runs a row, a plan without intervals)
are checked cell by cell without compiling; ``test_flex_grid.py`` has the generic grid's axes on one
shape (the generic backend tests leave flex out) and the failures (a mod compiled Flex gets wrong,
a mod TorchDynamo cannot trace).
"""

from __future__ import annotations

import math
import threading
import time
import types

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks, nonfinite, scores
from attnkit.backends import flex
from attnkit.backends.flex import FlexBackend
from attnkit.cache import KVCache
from attnkit.call import validate_call
from attnkit.maskplan.tile_kinds import EMPTY, FULL, PARTIAL
from tests.support import oracle
from tests.support.tolerances import close

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

B, H, L, E = 2, 4, 80, 16
BLOCK = 16
SMALL = FlexBackend(block_size=BLOCK)
DOCS = torch.tensor([[0] * 30 + [1] * 35 + [2] * 15, [0] * 50 + [1] * 30])
#: Query 5 of batch element 1 belongs to no document of the keys: a row with nothing to attend.
Q_DOCS = DOCS.clone()
Q_DOCS[1, 5] = 7


def qkv(b=B, h=H, hkv=H, lq=L, lk=L, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n_h, n, E, generator=g, dtype=torch.float64).to(dtype)
            for n_h, n in ((h, lq), (hkv, lk), (hkv, lk))]


def documents(b, h, q_idx, kv_idx):
    """A user's own mask_mod: same document (per batch element), with a dead row."""
    return Q_DOCS[b, q_idx] == DOCS[b, kv_idx]


def row_band_mask(seed=1) -> torch.Tensor:
    """A dense bool ``[B, 1, L, L]`` mask whose rows are one run of keys each (so it has an interval
    form), at random places, and row 9 of batch element 0 empty."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.randint(0, L, (B, 1, L, 1), generator=g)
    width = torch.randint(1, 30, (B, 1, L, 1), generator=g)
    kv = torch.arange(L)
    m = (kv >= lo) & (kv < lo + width)
    m[0, 0, 9] = False
    return m


def block_pattern(seed=3) -> torch.Tensor:
    """A dense bool ``[B, 1, L, L]`` mask of ``BLOCK`` x ``BLOCK`` blocks, each empty, full or random cells
    (rows of many runs of keys)."""
    g = torch.Generator().manual_seed(seed)
    n = L // BLOCK
    kind = torch.randint(0, 3, (B, 1, n, n), generator=g).repeat_interleave(BLOCK, 2).repeat_interleave(BLOCK, 3)
    return (kind == FULL) | ((kind == PARTIAL) & (torch.rand(B, 1, L, L, generator=g) > 0.5))


def forward(backend, q, k, v, *, falls_back=False, **kw):
    """The backend's output through the NaN rule (as attnkit.attention runs it), without gradients;
    unless ``falls_back``, checked to be flex's own (its family compiled and passed its first check)."""
    with torch.no_grad():
        req = validate_call(q, k, v, **kw)
        out = nonfinite.call(backend, req)[0]
        family = flex._inputs(req, backend.block_size).family
    assert falls_back or (family not in flex._failed and flex._families[family].fn is not None), \
        f"flex did not serve this call: {flex._failed.get(family)}"
    return out


def expected(q, k, v, *, allowed=None, score_mod=None, **kw):
    if allowed is None:
        allowed = oracle.allowed_grid(q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                                      is_causal=kw.get("is_causal", False), window=kw.get("window"),
                                      mask_mod=kw.get("mask_mod"), mask=kw.get("mask"))
    return oracle.attention(q, k, v, allowed=allowed, score_mod=score_mod, scale=kw.get("scale"))[0]


# --------------------------------------------------------------------------------------------
# The BlockMask, block by block and cell by cell (nothing compiled)
# --------------------------------------------------------------------------------------------


def decoded(block_mask) -> torch.Tensor:
    """``[query blocks, key blocks]`` EMPTY/FULL/PARTIAL read back from a BlockMask's index tensors."""
    nq = block_mask.kv_num_blocks.shape[-1]
    nk = -(-block_mask.seq_lengths[1] // block_mask.BLOCK_SIZE[1])
    kinds = torch.full((nq, nk), EMPTY, dtype=torch.int8)
    for kind, count, index in ((PARTIAL, block_mask.kv_num_blocks, block_mask.kv_indices),
                               (FULL, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        assert count.shape[:2] == (1, 1)  # one layout, shared by every batch element and head
        for t in range(nq):
            at = index[0, 0, t, : int(count[0, 0, t])].long()
            assert bool((kinds[t, at] == EMPTY).all()), "a block listed twice"
            assert at.tolist() == sorted(at.tolist())
            kinds[t, at] = kind
    return kinds


def cells(req, block: int) -> torch.Tensor:
    """Bool ``[B, H, Lq, Lk]``: what Flex lets attend with this call's BlockMask and mask function:
    nothing in empty blocks, everything in full ones, the mask function on partial ones."""
    fn = flex._mask_function(req)[0]
    kinds = decoded(flex._inputs(req, block).args[4])
    b, h = torch.arange(B).view(-1, 1, 1, 1), torch.arange(req.heads).view(1, -1, 1, 1)
    out = torch.zeros(B, req.heads, req.q_len, req.kv_len, dtype=torch.bool)
    for t, j in (kinds != EMPTY).nonzero().tolist():
        rows, cols = slice(t * block, (t + 1) * block), slice(j * block, (j + 1) * block)
        q = torch.arange(req.q_len)[rows].view(1, 1, -1, 1)
        kv = torch.arange(req.kv_len)[cols].view(1, 1, 1, -1)
        out[..., rows, cols] = True if kinds[t, j] == FULL else fn(b, h, q, kv)
    return out


PLANS = {
    "no mask": lambda: {},
    "causal": lambda: {"is_causal": True},
    "window": lambda: {"window": (20, 3)},
    "causal window, Lq < Lk": lambda: {"is_causal": True, "window": (10, None), "lq": 50},
    "documents (mask_mod)": lambda: {"mask_mod": documents},
    "documents and causal": lambda: {"mask_mod": documents, "is_causal": True},
    "dense, an interval per row": lambda: {"mask": row_band_mask()},
    "dense, many intervals a row": lambda: {"mask": block_pattern()},
    "no interval form (more runs than a plan lists)": lambda: {"mask_mod": lambda b, h, q, kv: (kv % 2 == 0) | (q < 40),
                                                               "lq": 600, "lk": 600},
    "plan per head": lambda: {"mask": attnkit.mask_plan(lambda b, h, q, kv: (q - kv).abs() <= 4 * h + 1, q_len=L,
                                                        batch=B, heads=H)},
    "plan with 5 intervals a row": lambda: {"mask": attnkit.mask_plan(lambda b, h, q, kv: (kv % 16) < 2, q_len=L,
                                                                      batch=B)},
}


@pytest.mark.parametrize("block", [BLOCK, 32, flex.BLOCK_SIZE])
@pytest.mark.parametrize("case", list(PLANS))
def test_the_block_mask_is_the_plan_block_by_block_and_cell_by_cell(case, block):
    kw = PLANS[case]()
    q, k, v = qkv(lq=kw.pop("lq", L), lk=kw.pop("lk", L))
    req = validate_call(q, k, v, **kw)
    block_mask = flex._inputs(req, block).args[4]
    assert block_mask.BLOCK_SIZE == (block, block) and block_mask.seq_lengths == (req.q_len, req.kv_len)
    kinds = decoded(block_mask)
    plan = req.mask_plan
    if plan is not None and plan.starts is not None:
        assert torch.equal(kinds, plan.kinds(block, block))
    want = req.dense_mask() if not isinstance(req.mask_mod, attnkit.MaskPlan) else \
        masks.materialize(req.mask_mod, B, H, req.q_len, req.kv_len)
    want = torch.ones(req.q_len, req.kv_len, dtype=torch.bool) if want is None else want
    assert torch.equal(cells(req, block), want.expand(B, H, req.q_len, req.kv_len))
    if block == BLOCK and case in ("causal", "dense, many intervals a row"):
        assert set(kinds.unique().tolist()) == {EMPTY, FULL, PARTIAL}  # all three kinds are exercised


def test_how_each_mask_reaches_the_partial_blocks():
    q, k, v = qkv()
    words = {name: flex._mask_function(validate_call(q, k, v, **PLANS[name]()))[2] for name in PLANS
             if "lq" not in PLANS[name]()}
    assert words["causal"] == words["window"] == "is_causal/window"
    assert words["documents and causal"] == "is_causal/window and mask_mod 'documents'"
    assert words["dense, an interval per row"] == "the plan's intervals (1 per row)"
    assert words["dense, many intervals a row"] == "a dense mask"
    assert words["plan per head"] == "the plan's intervals (1 per row)"
    assert words["plan with 5 intervals a row"] == "the plan's predicate"
    assert words["no mask"] == "no mask"


# --------------------------------------------------------------------------------------------
# Refusals and selection (nothing compiled)
# --------------------------------------------------------------------------------------------


def test_float64_and_cpu_gradients_are_refused_with_flex_own_reasons():
    q, k, v = qkv(dtype=torch.float64)
    with pytest.raises(ValueError, match="FlexAttention computes in float32, bfloat16 and float16, got torch.float64"):
        SMALL(validate_call(q, k, v, is_causal=True))  # a direct call says why, as a forced backend does
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    with pytest.raises(ValueError, match="FlexAttention does not support backward on CPU"):
        attnkit.which_backend(q, k, v, is_causal=True, backend="flex")
    slopes = torch.nn.Parameter(scores.alibi_slopes(H))  # a gradient is needed for what the score_mod captures
    with pytest.raises(ValueError, match="does not support backward on CPU"):
        attnkit.which_backend(*(t.detach() for t in (q, k, v)), score_mod=scores.alibi(slopes), backend="flex")
    with torch.no_grad():
        assert attnkit.which_backend(q, k, v, is_causal=True, backend="flex") == "flex"
        assert attnkit.which_backend(q, k, v, score_mod=scores.alibi(slopes), backend="flex") == "flex"
        # inputs that require grad, under no_grad: served (Flex gets them detached), the band kernel of the grid
        q, k, v = (t.requires_grad_() for t in qkv())
        close(SMALL(validate_call(q, k, v, is_causal=True))[0], expected(q, k, v, is_causal=True), torch.float32)


@pytest.mark.parametrize("kw, why", [
    ({"return_weights": True}, "never forms the weights"),
    ({"dropout_p": 0.1}, "dropout is not implemented in the flex backend"),
    ({"bias": torch.zeros(L, L)}, "a dense bias is not served by flex"),
], ids=["weights", "dropout", "bias"])
def test_what_flex_does_not_serve_is_refused_by_name(kw, why):
    q, k, v = qkv()
    with torch.no_grad(), pytest.raises(ValueError, match=f"backend 'flex' cannot serve this call .*: .*{why}"):
        attnkit.which_backend(q, k, v, backend="flex", **kw)
    with torch.no_grad(), pytest.raises(ValueError, match="an empty call"):
        attnkit.which_backend(*qkv(lk=0), backend="flex")


def test_on_the_cpu_auto_never_picks_flex_and_on_cuda_it_comes_after_sdpa():
    order = attnkit.backends.auto_order("cpu")
    assert order == attnkit.backends.AUTO_ORDER and order[-1] == "flex"
    assert order[:-1] == ["decode", "sdpa", "band", "fused_tiles", "tiles", "reference"]
    assert attnkit.backends.auto_order(torch.device("cuda", 0))[:2] == ["sdpa", "flex"]
    # the "blockwise" family: flex first on CUDA, not a member on the CPU
    assert attnkit.backends.family_order("blockwise", "cpu") == ["band", "fused_tiles", "tiles"]
    assert attnkit.backends.family_order("blockwise", "cuda") == ["flex", "band", "fused_tiles", "tiles"]
    q, k, v = qkv()
    with torch.no_grad():  # what flex serves goes to the CPU kernels (these two ask for no band kernel build)
        cosine = lambda s, b, h, i, j: s * torch.cos(s)  # noqa: E731
        assert attnkit.which_backend(q, k, v, is_causal=True, score_mod=cosine) == "tiles"
        assert attnkit.which_backend(q, k, v, is_causal=True, score_mod=cosine, backend="blockwise") == "tiles"
        assert attnkit.which_backend(q, k, v, mask_mod=documents, return_weights=True) == "reference"
    with pytest.raises(ValueError, match="block_size must be a positive int or None, got 0"):
        FlexBackend(block_size=0)


# --------------------------------------------------------------------------------------------
# Compiling: once per family, logged; a failure is a refusal and a warning (a stand-in compiler)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def stand_in_compiler(monkeypatch):
    """``flex._compile`` replaced by the test's ``.compiler``, counting its calls in ``.made``; the families
    it made are forgotten after."""
    stand_in = types.SimpleNamespace(made=[], compiler=None)

    def compile_(lse=False, dynamic=False):
        stand_in.made.append(1)
        return stand_in.compiler(lse) if lse else stand_in.compiler()

    monkeypatch.setattr(flex, "_compile", compile_)
    before_families, before_failed, before_static = set(flex._families), set(flex._failed), set(flex._static_only)
    yield stand_in
    for key in set(flex._families) - before_families:
        flex._families.pop(key, None)
    for key in set(flex._failed) - before_failed:
        flex._failed.pop(key, None)
    flex._static_only.intersection_update(before_static)


def test_threads_making_a_family_first_call_together_wait_for_one_compile(stand_in_compiler, said):
    def compiler():
        def kernel(q, k, v, score_mod, block_mask, scale, enable_gqa):
            time.sleep(0.2)  # the compile, as long as the other threads take to arrive
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return kernel

    stand_in_compiler.compiler = compiler
    q, k, v = qkv(lq=7, lk=7)  # a family no other test compiles
    outs = []

    def call():
        outs.append(forward(SMALL, q, k, v, is_causal=True))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(stand_in_compiler.made) == 1 and len(outs) == 4
    for out in outs:
        close(out, expected(q, k, v, is_causal=True), torch.float32)
    err = said()
    assert err.count("attnkit: compiling PyTorch's flex_attention for torch.float32 q (2, 4, 7, 16)") == 1
    assert err.count("attnkit: compiled in") == 1


def test_a_family_that_fails_to_compile_falls_back_and_is_then_refused_with_the_reason(stand_in_compiler, said):
    def compiler():
        def kernel(*args):
            raise RuntimeError("no C++ compiler found\nsecond line")
        return kernel

    stand_in_compiler.compiler = compiler
    q, k, v = qkv(lq=9, lk=9)
    out = forward(SMALL, q, k, v, is_causal=True, falls_back=True)  # served by the fallback (the reference)
    close(out, expected(q, k, v, is_causal=True), torch.float32)
    assert "compiled flex_attention cannot serve this call (RuntimeError: no C++ compiler found); the reference " \
        "backend serves it" in said()
    registered = attnkit.backends.get("flex")  # its fallback: the next backend of the device's order that serves
    assert registered.fallback(validate_call(q, k, v, is_causal=True)).name == "sdpa"
    assert registered.fallback(validate_call(q, k, v, window=(2, 2), return_weights=True)).name == "reference"
    with torch.no_grad():
        assert SMALL.not_supported_reasons(validate_call(q, k, v, is_causal=True)) == [
            "compiled flex_attention cannot serve this family of calls: RuntimeError: no C++ compiler found"]
        assert not SMALL.not_supported_reasons(validate_call(*qkv(lq=10, lk=10), is_causal=True))  # another family
    assert len(stand_in_compiler.made) == 1  # not tried again


def test_a_family_whose_first_output_disagrees_with_the_formula_is_not_used(stand_in_compiler, said):
    def compiler():
        def kernel(q, k, v, score_mod, block_mask, scale, enable_gqa):  # forgets the mask
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        return kernel

    stand_in_compiler.compiler = compiler
    q, k, v = qkv(lq=11, lk=11)
    out = forward(SMALL, q, k, v, is_causal=True, falls_back=True)
    close(out, expected(q, k, v, is_causal=True), torch.float32)
    assert "(ValueError: the compiled kernel disagrees with the formula: batch 0, head 0, query 0: largest " \
           "difference" in said()
    with torch.no_grad(), pytest.raises(ValueError, match="backend 'flex' cannot serve this call .*: compiled "
                                                          "flex_attention cannot serve this family of calls"):
        SMALL(validate_call(q, k, v, is_causal=True))  # a direct call says why, as a forced backend does


def test_a_sanitized_call_runs_on_its_own_inputs_not_on_those_worked_out_for_the_call_it_copies(stand_in_compiler):
    """Once a family has failed, flex works out its inputs (q, k and v detached) when asked whether it can serve.
    The NaN rule's sanitized copy of a call must not read those back: the copy once shared the original's
    derived state, and every row of the head came out NaN where only the rows that see the NaN may."""
    def compiler():
        if not stand_in_compiler.made[1:]:
            def kernel(*args):
                raise RuntimeError("a family that fails")
        else:
            def kernel(q, k, v, score_mod, block_mask, scale, enable_gqa):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return kernel

    stand_in_compiler.compiler = compiler
    forward(SMALL, *qkv(lq=13, lk=13), is_causal=True, falls_back=True)  # a family fails: flex._failed is not empty
    q, k, v = qkv(lq=40, lk=40)
    v[0, 0, 30] = float("nan")  # under causal, rows 30.. of batch 0 head 0 see it
    with torch.no_grad():
        out = attnkit.attention(q, k, v, is_causal=True, backend="flex")
    assert len(stand_in_compiler.made) == 2  # flex served it
    assert bool(out[0, 0, 30:].isnan().all()) and not bool(out[0, 0, :30].isnan().any())
    clean = v.clone()
    clean[0, 0, 30] = 0.0
    want = expected(q, k, clean, is_causal=True)
    close(out[0, 0, :30], want[0, 0, :30], torch.float32)
    close(out[1], want[1], torch.float32)


def test_a_cached_step_reads_the_keys_it_wrote_not_copies_made_before_the_write(stand_in_compiler):
    """A cached step is checked whole (its backend chosen) before the new token is written; flex, asked then,
    works out its inputs (here padded copies of q and k: a head size below ``CPU_MIN_HEAD_DIM``). What it
    worked out is dropped once the token is written, so the step attends over the token, not over the copy."""
    def compiler():
        if not stand_in_compiler.made[1:]:
            def kernel(*args):
                raise RuntimeError("a family that fails")
        else:
            def kernel(q, k, v, score_mod, block_mask, scale, enable_gqa):  # no mask in these calls
                return F.scaled_dot_product_attention(q, k, v, scale=scale)
        return kernel

    stand_in_compiler.compiler = compiler
    forward(SMALL, *qkv(lq=13, lk=13), is_causal=True, falls_back=True)  # a family fails: flex._failed is not empty
    torch.manual_seed(7)
    mha = attnkit.MultiHeadAttention(16, 2, backend="flex").eval()  # head size 8
    x = torch.randn(1, 5, 16)
    cache = KVCache(1, 8, 2, 8)
    with torch.no_grad():
        mha(x[:, :4], cache=cache)
        step = mha(x[:, 4:], cache=cache)
        full = mha(x)
    close(step, full[:, 4:], torch.float32)


def test_attention_with_lse_gives_each_row_its_log_sum_exp_and_both_gradients(stand_in_compiler):
    """What ring attention merges its blocks with: the output and each row's log-sum-exp (-inf and zeros for a
    row that sees nothing), differentiable in both (CUDA's compiled Flex; here Flex's own eager maths, which
    PyTorch refuses a CPU backward only at its door)."""
    import torch.nn.attention.flex_attention as fa

    stand_in_compiler.compiler = flex._flex_call  # Flex uncompiled
    q, k, v = (t.requires_grad_() for t in qkv(hkv=2, lq=12, lk=9, seed=3))
    alibi = scores.alibi(scores.alibi_slopes(H))
    dead = masks.padding_mod(torch.tensor([9, 0]))  # batch element 1 sees no key
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fa, "_validate_device", lambda *args: None)
        out, lse = flex.attention_with_lse(validate_call(q, k, v, mask_mod=dead, window=(4, 1), score_mod=alibi),
                                           block_size=BLOCK)
        g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
        got = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    kv = ref_in[1].repeat_interleave(H // 2, 1), ref_in[2].repeat_interleave(H // 2, 1)
    s = alibi(ref_in[0] @ kv[0].transpose(-1, -2) / math.sqrt(E), *oracle_grid(2, H, 12, 9))
    allowed = oracle.allowed_grid(2, H, 12, 9, window=(4, 1), mask_mod=dead)
    s = s.masked_fill(~allowed, -math.inf)
    want_lse = s.logsumexp(-1)
    want = torch.where(torch.isneginf(want_lse)[..., None], 0.0, torch.softmax(s, -1).nan_to_num(0.0)) @ kv[1]
    assert bool(torch.isneginf(lse[1]).all()) and not bool(out[1].any())
    close(out, want, torch.float32)
    close(lse, want_lse, torch.float32)
    live = torch.where(torch.isneginf(want_lse), 0.0, want_lse)  # the dead rows' -inf has no gradient
    want_grads = torch.autograd.grad(((want * g_out.double()).sum() + (live * g_lse.double()).sum()), ref_in)
    for a, b in zip(got, want_grads, strict=True):
        close(a, b, torch.float32)


def test_a_family_whose_log_sum_exp_disagrees_with_the_formula_is_not_used(stand_in_compiler):
    def compiler(lse):
        def kernel(*args):
            out, l = flex._flex_call(lse)(*args)
            return out, l + 1e-2  # the output right, its log-sum-exp off
        return kernel

    import torch.nn.attention.flex_attention as fa

    stand_in_compiler.compiler = compiler
    q, k, v = qkv(lq=13, lk=13)
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(fa, "_validate_device", lambda *args: None)
        with pytest.raises(flex.CompileFailed, match="the compiled kernel disagrees with the formula: batch 0, head 0, "
                                                     "query 0: the log-sum-exp 0.01"):
            flex.attention_with_lse(validate_call(q, k, v, is_causal=True), block_size=BLOCK)


def _recompiling(wrong: bool):
    """A stand-in compiler whose kernel (Flex uncompiled) serves its first sizes and, at the next, "compiles
    again" (TorchDynamo's graph count moves) and then raises, or (``wrong``) forgets the mask."""
    from torch._dynamo.utils import counters

    def compiler():
        first = []
        flex_eager = flex._flex_call()

        def kernel(q, k, v, score_mod, block_mask, *rest):
            first.append(first[0] if first else k.shape[2])
            if k.shape[2] != first[0]:
                counters["stats"]["unique_graphs"] += 1
                if not wrong:
                    raise torch._dynamo.exc.TorchDynamoException("a recompile for variable lengths failed")
                block_mask = None
            return flex_eager(q, k, v, score_mod, block_mask, *rest)
        return kernel

    return compiler


@pytest.mark.parametrize("wrong", [False, True], ids=["recompile fails", "recompile disagrees"])
def test_a_family_of_every_length_whose_recompile_fails_goes_to_one_family_per_length(
        stand_in_compiler, monkeypatch, said, wrong):
    """On CUDA a family takes every length; where TorchDynamo's recompile for new lengths fails, or what it
    compiled disagrees with the formula (checked after every call that compiled), that call is served by the
    fallback and the family's calls go to one kernel per length from then on, each compiled and checked."""
    monkeypatch.setattr(flex, "DYNAMIC_DEVICES", ("cpu",))
    stand_in_compiler.compiler = _recompiling(wrong)
    first = qkv(lq=14, lk=14)
    close(forward(SMALL, *first, window=(3, 0)), expected(*first, window=(3, 0)), torch.float32)
    with torch.no_grad():
        family = flex._inputs(validate_call(*first, window=(3, 0)), BLOCK).family
    assert family[-1] is None  # no lengths: this family serves every length
    decode = qkv(lq=1, lk=15, seed=1)
    close(forward(SMALL, *decode, window=(3, 0), falls_back=True), expected(*decode, window=(3, 0)), torch.float32)
    err = said()
    cause = ("ValueError: the recompiled kernel disagrees with the formula" if wrong
             else "TorchDynamoException: a recompile for variable lengths failed")
    assert f"compiled flex_attention cannot serve this call ({cause}" in err
    assert "; from now on, one kernel per length); the reference backend serves it" in err
    assert family in flex._static_only and family not in flex._failed
    close(forward(SMALL, *decode, window=(3, 0)), expected(*decode, window=(3, 0)), torch.float32)  # compiled anew
    with torch.no_grad():
        assert flex._inputs(validate_call(*decode, window=(3, 0)), BLOCK).family[-1] == (1, 15)
    assert len(stand_in_compiler.made) == 2
    assert "once per shape, dtype and mod" in said()


@pytest.mark.slow
def test_on_cuda_a_decode_loop_compiles_flex_twice_not_once_per_step(monkeypatch, said):
    """What CUDA does (:data:`flex.DYNAMIC_DEVICES`), run on the CPU with PyTorch's compile: a prefill, then
    decode steps whose key length grows. The kernel is compiled for the prefill's sizes and once more for the
    first step (the key length then a variable, the one query compiled in); no later step compiles. Every
    output against the oracle, the score mod's clamped indices included."""
    monkeypatch.setattr(flex, "DYNAMIC_DEVICES", ("cpu",))
    alibi = scores.alibi(scores.alibi_slopes(H))
    kw = {"window": (20, 0), "score_mod": alibi}
    for lq, lk in ((40, 40), (1, 41), (1, 42), (1, 77), (1, 127)):  # (one key block of 128 throughout)
        q, k, v = qkv(b=1, lq=lq, lk=lk, seed=lk)
        with torch.no_grad():
            out = flex.FlexBackend()(validate_call(q, k, v, **kw))[0]
        allowed = oracle.allowed_grid(1, H, lq, lk, window=(20, 0))
        close(out, oracle.attention(q, k, v, allowed=allowed, score_mod=alibi)[0], torch.float32)
    err = said()
    assert err.count("attnkit: compiling PyTorch's flex_attention for torch.float32 q (1, 4, 40, 16)") == 1, err
    assert "again the first time the lengths change" in err
    assert err.count("attnkit: compiled flex_attention again for torch.float32 q (1, 4, 1, 16), k (1, 4, 41, 16)") == 1
    assert err.count("compiled flex_attention again") == 1 and "cannot serve" not in err, err


def test_the_lengths_a_mod_reads_are_made_once_and_never_as_inference_tensors():
    """Every layer and decode step shares the 0-d tensors its mods read (no copy to the device per call); one made
    first under inference mode would break a later backward that saves it."""
    with torch.inference_mode():
        q_last, kv_last = flex._last_indices(validate_call(*qkv(lq=5, lk=9)))
    assert (int(q_last), int(kv_last)) == (4, 8) and not q_last.is_inference() and not kv_last.is_inference()
    again = flex._last_indices(validate_call(*qkv(b=1, lq=5, lk=9)))
    assert again[0] is q_last and again[1] is kv_last


def oracle_grid(*sizes):
    return [torch.arange(n).view([-1 if d == i else 1 for d in range(4)]) for i, n in enumerate(sizes)]


# --------------------------------------------------------------------------------------------
# Forward against the float64 oracle (compiled; kernels shared across cases)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kw", [{"is_causal": True}, {"window": (9, 2)}, {"window": (None, 5), "is_causal": True}],
                         ids=["causal", "window", "causal+window"])
def test_band_masks_match_the_oracle(kw, dtype):
    q, k, v = qkv(dtype=dtype)
    out = forward(SMALL, q, k, v, **kw)
    assert out.dtype == dtype
    close(out, expected(q, k, v, **kw), dtype)


def test_batch_dims_are_flattened_for_flex_and_restored():
    q, k, v = (t.view(B, 1, H, L, E) for t in qkv())  # [B, 1, H, L, E]: the band kernel of the tests above
    out = forward(SMALL, q, k, v, window=(9, 2))
    assert out.shape == (B, 1, H, L, E)
    close(out[:, 0], expected(*(t[:, 0] for t in (q, k, v)), window=(9, 2)), torch.float32)


def test_a_user_mask_mod_and_a_score_mod_match_the_oracle_the_dead_row_is_zero_and_a_nan_score_poisons_its_rows():
    q, k, v = qkv()
    slopes = scores.alibi_slopes(H)
    kw = {"mask_mod": documents, "is_causal": True}
    out = forward(SMALL, q, k, v, score_mod=scores.alibi(slopes), **kw)
    want = expected(q, k, v, score_mod=scores.alibi(slopes), **kw)
    close(out, want, torch.float32)
    assert torch.equal(out[1, :, 5], torch.zeros(H, E))
    bad = slopes.clone()
    bad[2] = float("nan")  # head 2's scores are NaN at every cell: its live rows, and only they, are NaN
    out = forward(SMALL, q, k, v, score_mod=scores.alibi(bad), **kw)
    assert bool(out[0, 2].isnan().all()) and bool(out[1, 2, :5].isnan().all()) and bool(out[1, 2, 6:].isnan().all())
    assert torch.equal(out[1, 2, 5], torch.zeros(E))  # a dead row sees no score, NaN or not
    close(out[:, [0, 1, 3]], want[:, [0, 1, 3]], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_dense_mask_and_a_plan_match_the_oracle(dtype):
    q, k, v = qkv(dtype=dtype)
    dense = row_band_mask()
    out = forward(SMALL, q, k, v, mask=dense)
    close(out, expected(q, k, v, allowed=dense), dtype)
    assert torch.equal(out[0, :, 9], torch.zeros(H, E, dtype=dtype))
    # a per-batch plan with one interval a row: the same compiled kernel, other intervals
    plan = attnkit.mask_plan(masks.document_mod(DOCS), q_len=L, batch=B)
    out = forward(SMALL, q, k, v, mask=plan)
    close(out, expected(q, k, v, allowed=masks.materialize(plan, B, H, L, L)), dtype)


def test_layers_sharing_a_plan_share_one_block_mask_made_once():
    """What the transformers integration does: every layer of a forward gets the same MaskPlan. The first call
    makes the BlockMask and keeps it on the plan; the next layers (other q, k, v) reuse it; another plan, or
    another head count, makes its own. Nothing compiles here."""
    plan = attnkit.mask_plan(masks.document_mod(DOCS), q_len=L, batch=B)
    with torch.no_grad():
        first = flex._inputs(validate_call(*qkv(seed=1), mask=plan), BLOCK).args[4]
        again = flex._inputs(validate_call(*qkv(seed=2), mask=plan), BLOCK).args[4]
        assert again is first
        other_plan = attnkit.mask_plan(masks.document_mod(DOCS), q_len=L, batch=B)
        assert flex._inputs(validate_call(*qkv(seed=1), mask=other_plan), BLOCK).args[4] is not first
        assert flex._inputs(validate_call(*qkv(h=2, hkv=2, seed=1), mask=plan), BLOCK).args[4] is not first
    assert torch.equal(first.to_dense(), flex._block_mask(validate_call(*qkv(), mask=plan), BLOCK,
                                                          flex._mask_function(validate_call(*qkv(), mask=plan))[0])
                       .to_dense())


def test_nan_in_the_inputs_reaches_only_the_rows_that_see_it():
    q, k, v = qkv()
    k[0, 1, 40] = float("nan")  # under causal, rows 40.. of batch 0 head 1 see it
    out = forward(SMALL, q, k, v, is_causal=True)
    assert bool(out[0, 1, 40:].isnan().all()) and not bool(out[0, 1, :40].isnan().any())
    clean = k.clone()
    clean[0, 1, 40] = 0.0
    want = expected(q, clean, v, is_causal=True)
    close(out[0, 1, :40], want[0, 1, :40], torch.float32)
    close(out[1], want[1], torch.float32)


#: A user's own relative-position table, one row per head, for key - query from -119 to 119.
TABLE = torch.randn(4, 2 * 120 - 1, generator=torch.Generator().manual_seed(4))


def relative(s, b, h, q_idx, kv_idx):
    return s + TABLE[h, kv_idx - q_idx + 119]


def test_the_registered_backend_serves_a_score_mod_without_a_mask_with_gqa_and_lq_below_lk(said):
    """Through ``attnkit.attention`` at Flex's own block size; no mask: a BlockMask of full blocks."""
    q, k, v = qkv(b=1, h=4, hkv=2, lq=100, lk=120)
    with torch.no_grad():
        assert attnkit.which_backend(q, k, v, score_mod=relative, backend="flex") == "flex"
        out = attnkit.attention(q, k, v, score_mod=relative, scale=0.3, backend="flex")
    close(out, expected(q, k, v, score_mod=relative, scale=0.3), torch.float32)
    assert "cannot serve" not in said()  # flex served it, no fallback


@pytest.mark.slow
def test_under_torch_compile_flex_runs_in_the_callers_graph_without_a_break():
    """Traced by torch.compile (``fullgraph=True``: no break), flex calls ``flex_attention`` in the caller's graph
    with a BlockMask from ``create_block_mask`` traced there too: a window with a dense mask shared by every batch
    element and head (one BlockMask for all of them), a score_mod and GQA; and a MaskPlan taken as an input,
    through the predicate it was made from (per batch element, with a dead row). Both against the oracle."""
    q, k, v = qkv(hkv=2, lq=L, lk=L)
    alibi = scores.alibi(scores.alibi_slopes(H))
    kw = {"window": (9, 2), "mask": row_band_mask()[:1], "score_mod": alibi}
    plan = attnkit.mask_plan(documents, q_len=L, batch=B, window=(9, 2))  # worked out on the host, an input

    @torch.compile(fullgraph=True)
    def both(q, k, v, plan):  # (one graph, one compile, for both calls)
        return attnkit.attention(q, k, v, backend="flex", **kw), attnkit.attention(q, k, v, mask=plan, backend="flex")

    with torch.no_grad():
        out, planned = both(q, k, v, plan)
    close(out, expected(q, k, v, **kw), torch.float32)
    close(planned, expected(q, k, v, mask_mod=documents, window=(9, 2)), torch.float32)
    assert torch.equal(planned[1, :, 5], torch.zeros(H, E))


def followed_by_nan(t: torch.Tensor) -> torch.Tensor:
    """``t`` at the front of a larger buffer of NaN: whatever reads past its end reads NaN."""
    buf = torch.full((t.numel() + 4096,), float("nan"), dtype=t.dtype)
    buf[: t.numel()] = t.flatten()
    return buf[: t.numel()].view(t.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_no_key_past_the_end_of_k_reaches_the_output(dtype, said):
    """PyTorch 2.13's CPU Flex, at a head dim that is a multiple of the vector width and below 24, reads
    keys past the end of ``k`` where a block of keys ends in a multiple of the vector width short of 16
    (here the one block of 120 = 7 * 16 + 8 keys; the vector is 8 floats under AVX2), and writes their
    scores past the block's row of scores, onto the running row maxima when the block is as long as
    the rows (``Lk`` no longer than the block size). The rows of the last (batch element, key head)
    then depended on the memory after ``k``: the bfloat16 oracle grid (``Lk`` = 8) gave zeros or garbage
    there only after other calls had left garbage in it. Here ``k`` is followed by NaN (the compiled
    kernel of the test above); Flex now gets ``q`` and ``k`` with zero columns up to
    ``flex.CPU_MIN_HEAD_DIM``."""
    q, k, v = qkv(b=1, h=4, hkv=2, lq=100, lk=120, dtype=dtype)
    k, v = followed_by_nan(k), followed_by_nan(v)
    with torch.no_grad():
        out = attnkit.attention(q, k, v, score_mod=relative, scale=0.3, backend="flex")
    assert "cannot serve" not in said()  # flex served it (the first call's check passed)
    assert out.dtype == dtype
    close(out, expected(q, k, v, score_mod=relative, scale=0.3), dtype)
