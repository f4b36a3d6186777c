"""The "flex" backend on a CUDA device: the CPU grid of ``tests/backends/test_flex.py`` with gradients.

Skipped without CUDA. On a CUDA machine, run ``python -m pytest -q tests/gpu``: every mask family
(causal, window, documents through a user's ``mask_mod``, a dense mask, a ``MaskPlan``), a
``score_mod`` whose captured tensors learn (ALiBi slopes, a relative-position table), GQA,
``Lq != Lk`` and a row with nothing to attend, in float32, bfloat16 and float16: outputs against
the float64 oracle, gradients (``q``, ``k``, ``v`` and the captured tensors) against the reference
backend in float64 on the CPU. Also: the automatic order on CUDA takes SDPA for what it does
exactly and flex for the rest.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks, scores
from tests.support import oracle
from tests.support.tolerances import close

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

B, H, L, E = 2, 4, 300, 64  # three of Flex's 128-blocks: empty, full and partial ones
DOCS = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50, [0] * 200 + [1] * 100])
Q_DOCS = DOCS.clone()
Q_DOCS[1, 5] = 7  # a query of no document the keys have: a row with nothing to attend
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def qkv(b=B, h=H, hkv=H, lq=L, lk=L, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n_h, n, E, generator=g, dtype=torch.float64).to(dtype).cuda().requires_grad_()
            for n_h, n in ((h, lq), (hkv, lk), (hkv, lk))]


def dense_rows(seed=1) -> torch.Tensor:
    """Bool ``[B, 1, L, L]``: one run of keys per row at random places, row 9 of batch 0 empty."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.randint(0, L, (B, 1, L, 1), generator=g)
    width = torch.randint(1, 90, (B, 1, L, 1), generator=g)
    kv = torch.arange(L)
    m = (kv >= lo) & (kv < lo + width)
    m[0, 0, 9] = False
    return m


def _documents_on(device):
    q_docs, docs = Q_DOCS.to(device), DOCS.to(device)

    def documents(b, h, q_idx, kv_idx):
        return q_docs[b, q_idx] == docs[b, kv_idx]

    return documents


CASES = {
    "causal": lambda dev: {"is_causal": True},
    "window": lambda dev: {"window": (40, 7)},
    "documents, causal": lambda dev: {"mask_mod": _documents_on(dev), "is_causal": True},
    "dense mask": lambda dev: {"mask": dense_rows().to(dev)},
    "plan": lambda dev: {"mask": attnkit.mask_plan(masks.document_mod(DOCS.to(dev)), q_len=L, batch=B, device=dev)},
    # the global positions on the device, as a GPU user passes them (the plan is still made on the host)
    "Longformer": lambda dev: {"mask_mod": masks.global_tokens_mod(20, torch.tensor([0, 150, 299], device=dev))},
}


def check(build, q, k, v, captured=()):
    """flex on CUDA against the float64 oracle (output) and the float64 reference backend on the CPU
    (gradients of ``q``, ``k``, ``v`` and the ``captured`` tensors). ``build(device, *captured)`` gives
    the keyword arguments of ``attnkit.attention`` on that device."""
    dtype = q.dtype
    kw = build("cuda", *captured)
    assert attnkit.which_backend(q, k, v, backend="flex", **kw) == "flex"
    out = attnkit.attention(q, k, v, backend="flex", **kw)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, *captured), dout)
    q64, k64, v64, *cap64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v, *captured))
    kw64 = build("cpu", *cap64)
    want = attnkit.attention(q64, k64, v64, backend="reference", **kw64)
    allowed = attnkit.call.validate_call(q64, k64, v64, **kw64).dense_mask()
    truth = oracle.attention(q64, k64, v64, score_mod=kw64.get("score_mod"),
                             allowed=None if allowed is None else allowed.expand(want.shape[:-1] + (L,)))[0]
    close(out, truth, dtype)
    close(want, truth, torch.float64)
    for g_flex, g_ref in zip(got, torch.autograd.grad(want, (q64, k64, v64, *cap64), dout.cpu().double()),
                             strict=True):
        close(g_flex, g_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_mask_family_forward_and_backward(case, dtype):
    check(CASES[case], *qkv(dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_score_mods_learn_their_captured_tensors(dtype):
    slopes = torch.nn.Parameter(scores.alibi_slopes(H, device="cuda"))
    check(lambda dev, s: {"is_causal": True, "score_mod": scores.alibi(s)}, *qkv(dtype=dtype), captured=(slopes,))
    table = torch.nn.Parameter(torch.randn(H, 2 * 16 + 1, device="cuda") * 0.1)
    check(lambda dev, t: {"window": (64, 64), "score_mod": scores.relative_position_bias(t, 16)},
          *qkv(dtype=dtype), captured=(table,))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gqa_and_lq_below_lk(dtype):
    check(lambda dev: {"is_causal": True, "window": (200, None)}, *qkv(h=8, hkv=2, lq=130, lk=L, dtype=dtype))


def test_dead_rows_give_zero_output_and_zero_gradient():
    q, k, v = qkv()
    out = attnkit.attention(q, k, v, backend="flex", mask_mod=_documents_on("cuda"), is_causal=True)
    assert torch.equal(out[1, :, 5], torch.zeros_like(out[1, :, 5]))
    dq, = torch.autograd.grad(out.sum(), (q,))
    assert torch.equal(dq[1, :, 5], torch.zeros_like(dq[1, :, 5]))


def test_on_cuda_auto_takes_sdpa_for_what_it_does_exactly_and_flex_for_the_rest():
    q, k, v = qkv()
    assert attnkit.which_backend(q, k, v) == "sdpa"
    assert attnkit.which_backend(q, k, v, is_causal=True) == "sdpa"
    assert attnkit.which_backend(q, k, v, window=(40, 0)) == "flex"
    assert attnkit.which_backend(q, k, v, mask_mod=_documents_on("cuda")) == "flex"
    assert attnkit.which_backend(q, k, v, score_mod=scores.softcap(20.0)) == "flex"
    assert attnkit.which_backend(q, k, v, window=(40, 0), return_weights=True) == "reference"
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))  # flex computes no float64: tiles
    assert attnkit.which_backend(q64, k64, v64, window=(40, 0)) == "tiles"
    assert attnkit.which_backend(q, k, v, window=(40, 0), backend="blockwise") == "flex"
    assert attnkit.which_backend(q64, k64, v64, window=(40, 0), backend="blockwise") == "tiles"


def test_a_decode_loop_compiles_flex_a_few_times_not_once_per_step(said):
    """A prefill, decode steps whose key length grows, a prompt of another length and its steps, with a window
    and ALiBi (flex's work on CUDA): each output against the float64 oracle, and the kernel compiled for the first
    sizes and again when they change (lengths then variables), not once per length."""
    slopes = scores.alibi_slopes(H, device="cuda")
    kw = {"window": (64, 0), "score_mod": scores.alibi(slopes)}
    steps = [(200, 200), *((1, n) for n in range(201, 211)), (150, 150), *((1, n) for n in range(151, 156))]
    for lq, lk in steps:
        q, k, v = (t.detach() for t in qkv(b=1, lq=lq, lk=lk, seed=lk))
        with torch.no_grad():
            out = attnkit.attention(q, k, v, **kw)
        q64, k64, v64 = (t.cpu().double() for t in (q, k, v))
        kw64 = {"window": (64, 0), "score_mod": scores.alibi(slopes.cpu().double())}
        allowed = attnkit.call.validate_call(q64, k64, v64, **kw64).dense_mask().expand(1, H, lq, lk)
        close(out, oracle.attention(q64, k64, v64, score_mod=kw64["score_mod"], allowed=allowed)[0], torch.float32)
    err = said()
    compiles = err.count("attnkit: compiling PyTorch's flex_attention") + err.count("compiled flex_attention again")
    assert compiles <= 4 and "cannot serve" not in err, err  # 17 lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_under_torch_compile_flex_serves_in_the_callers_graph_with_gradients(dtype):
    """A window and ALiBi traced by torch.compile (fullgraph: no break) on CUDA: flex_attention in the caller's
    graph, output against the float64 oracle and gradients against the reference backend on the CPU."""
    slopes = torch.nn.Parameter(scores.alibi_slopes(H, device="cuda"))
    q, k, v = qkv(dtype=dtype)
    run = torch.compile(lambda q, k, v, s: attnkit.attention(q, k, v, window=(40, 7), score_mod=scores.alibi(s)),
                        fullgraph=True)
    out = run(q, k, v, slopes)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, slopes), dout)
    q64, k64, v64, s64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v, slopes))
    want = attnkit.attention(q64, k64, v64, window=(40, 7), score_mod=scores.alibi(s64), backend="reference")
    close(out, want, dtype)
    for g, w in zip(got, torch.autograd.grad(want, (q64, k64, v64, s64), dout.cpu().double()), strict=True):
        close(g, w, dtype)
