"""attnkit under ``torch.compile`` and ``torch.export``: whole graphs, the same numbers, no recompiling per token.

Every mask family the engine serves traces with no graph break (``torch._dynamo.explain``) and,
compiled with ``fullgraph=True``, gives eager attnkit's output and gradients. Most cases compile
with the ``aot_eager`` backend (dynamo and AOTAutograd with fake tensors: what checks the
kernels' operators, their shape-only versions and their registered gradients) and a few with
inductor, the default. A compiled decode loop over a ``KVCache`` compiles once for every token,
and an exported encoder layer runs.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

import attnkit
from attnkit import MultiHeadAttention, masks, scores
from attnkit.backends import _band
from attnkit.cache import KVCache
from attnkit.modules.transformer import TransformerEncoderLayer
from tests.support.tolerances import close

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

B, H, L, E = 2, 4, 96, 8
DOCS = torch.tensor([0] * 40 + [1] * 30 + [2] * 26)
LENGTHS = torch.tensor([70, 96])


def _offset_bias(s, b, h, q, kv):  # a user's own ALiBi-like bias: probed eagerly, called under compile
    return s - 0.1 * (h + 1) * (q - kv).abs()


def _near(b, h, q, kv):  # a user's own predicate: whether it broadcasts is decided while tracing
    return (q - kv).abs() <= 6


IMAGES = torch.tensor([[0, 40], [40, 70], [70, 96]])
IMAGE_OF = torch.tensor([0] * 30 + [1] * 30 + [2] * 36)


def _flamingo(b, h, q, kv):  # written per element (FlexAttention's semantics): does not broadcast
    interval = IMAGES[IMAGE_OF[q]]
    return (kv >= interval[0]) & (kv < interval[1])


#: Every family: keyword arguments of attnkit.attention, built per test (plans are built outside).
FAMILIES = {
    "no mask": lambda: {},
    "causal": lambda: {"is_causal": True},
    "window": lambda: {"window": (16, 0)},
    "two-sided window": lambda: {"window": (8, 8)},
    "dense mask": lambda: {"mask": masks.causal(L)},
    "key padding (dense)": lambda: {"mask": masks.padding(LENGTHS, L)},
    "documents": lambda: {"mask_mod": masks.document_mod(DOCS)},
    "documents + causal": lambda: {"is_causal": True, "mask_mod": masks.document_mod(DOCS.expand(B, L))},
    "padding": lambda: {"mask_mod": masks.padding_mod(LENGTHS)},
    "prefix-LM": lambda: {"mask_mod": masks.prefix_lm_mod(torch.tensor([10, 50]))},
    "global tokens": lambda: {"mask_mod": masks.global_tokens_mod(8, [0, 1])},
    "dilated window": lambda: {"mask_mod": masks.dilated_window_mod(12, 2)},
    "strided": lambda: {"mask_mod": masks.strided_mod(12)},
    "block sparse": lambda: {"mask_mod": masks.block_sparse_mod(masks.bigbird_layout(L // 16, random_blocks=1), 16)},
    "user predicate": lambda: {"mask_mod": _near},
    "Flamingo (per element)": lambda: {"mask_mod": _flamingo},
    "plan of documents": lambda: {"mask": attnkit.mask_plan(masks.document_mod(DOCS), q_len=L, batch=B)},
    "plan of a predicate": lambda: {"mask": attnkit.mask_plan(_near, q_len=L, batch=B, window=(4, None))},
    "ALiBi": lambda: {"is_causal": True, "score_mod": scores.alibi(scores.alibi_slopes(H, dtype=torch.float64))},
    "relative positions": lambda: {"window": (16, 16), "score_mod": scores.relative_position_bias(TABLE, 8)},
    "soft cap": lambda: {"window": (16, 0), "score_mod": scores.softcap(2.0)},
    "user score_mod": lambda: {"window": (16, 0), "score_mod": _offset_bias},
}
INDUCTOR = ("window", "documents", "relative positions")
#: Where a compiled call runs when not on the banded kernel: dense masks on SDPA, a user's score_mod
#: (which cannot be probed while tracing) on the reference backend. (Plain causal: the band, which auto prefers.)
NOT_ON_BAND = ("no mask", "dense mask", "key padding (dense)", "user score_mod", "Flamingo (per element)")
#: A learned relative-position table: its gradient goes through the kernel's registered backward too.
TABLE = torch.randn(H, 17, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
LEARNED = {"relative positions": [TABLE]}


def _inputs(lq=L, lk=L, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, n, E, generator=gen, dtype=dtype).requires_grad_() for n in (lq, lk, lk)]


def _grads(out, tensors):
    return torch.autograd.grad(out.square().sum(), tensors)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    assert _band.available(), _band.unavailable_reason()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_traces_without_a_graph_break(family):
    kw = FAMILIES[family]()
    # How many intervals a row has is data for these: one operator finds out when it runs, which
    # dynamo keeps in the graph under fullgraph=True (as here) and otherwise splits the graph at.
    data_sized = family in ("documents", "documents + causal", "user predicate")
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=data_sized):
        explained = torch._dynamo.explain(lambda q, k, v: attnkit.attention(q, k, v, **kw))(*_inputs())
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    targets = {str(node.target) for node in explained.graphs[0].graph.nodes}
    assert any("attnkit.band_forward" in t for t in targets) == (family not in NOT_ON_BAND)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_equals_eager_with_gradients(family):
    kw = FAMILIES[family]()
    captured = LEARNED.get(family, [])
    fn = lambda q, k, v: attnkit.attention(q, k, v, **kw)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="inductor" if family in INDUCTOR else "aot_eager")
    q, k, v = _inputs()
    want = fn(q, k, v)
    got = compiled(q, k, v)
    close(got, want)
    for g, w in zip(_grads(got, [q, k, v, *captured]), _grads(want, [q, k, v, *captured]), strict=True):
        close(g, w)


def test_the_kernel_is_one_operator_with_a_shape_only_version_and_a_gradient():
    """``torch.library.opcheck``: schema, fake (meta) version against the real one, autograd registration."""
    q, k, v = _inputs(lq=20, lk=24)
    plan = attnkit.mask_plan(q_len=20, kv_len=24, is_causal=True, window=(5, 0))
    bias = torch.randn(1, 43, dtype=torch.float64, requires_grad=True)
    args = (q, k, v, plan.starts, plan.ends, bias, 0.3, 0.0)
    torch.library.opcheck(torch.ops.attnkit.band_forward.default, args)
    out, stats = torch.ops.attnkit.band_forward(*args)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.attnkit.band_backward.default,  # a gradient, not differentiable itself
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), stats, plan.starts, plan.ends,
                           bias.detach(), 0.3, 0.0, False, True), test_utils=("test_schema", "test_faketensor"))


def test_multi_head_attention_compiles_with_inductor_forward_and_backward():
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, dtype=torch.float64)
    x = torch.randn(2, 80, 32, dtype=torch.float64, requires_grad=True)
    fn = lambda x: m(x, window=(12, 0), mask_mod=masks.padding_mod(torch.tensor([80, 61])))  # noqa: E731
    explained = torch._dynamo.explain(fn)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    compiled = torch.compile(fn, fullgraph=True)
    close(compiled(x), fn(x))
    params = [x, *m.parameters()]
    for g, w in zip(_grads(compiled(x), params), _grads(fn(x), params), strict=True):
        close(g, w)


@pytest.mark.parametrize("setup", ["causal", "window + rotary + GQA"])
def test_a_compiled_decode_loop_compiles_once_for_every_token(setup):
    torch.manual_seed(0)
    rotary = setup != "causal"
    m = MultiHeadAttention(32, 4, num_kv_heads=2 if rotary else None, dtype=torch.float64,
                           rotary=attnkit.positional.RotaryEmbedding(8) if rotary else None).eval()
    kw = {"is_causal": True, "window": (5, 0) if rotary else None}
    cache = KVCache(1, 40, m.num_kv_heads, m.head_dim, dtype=torch.float64)
    counter = CompileCounter()
    step = torch.compile(lambda x: m(x, cache=cache, **kw), backend=counter, fullgraph=True)
    xs = torch.randn(1, 24, 32, dtype=torch.float64)
    with torch.no_grad():
        prompt = m(xs[:, :4], cache=cache, **kw)  # an eager prefill, then compiled steps
        got = torch.cat([prompt, *(step(xs[:, i:i + 1]) for i in range(4, 24))], 1)
        assert cache.seq_len == 24  # the host mirror is read back from the tensor after compiled steps
        want = m(xs, **kw)
    assert counter.frame_count == 1  # one graph for the 20 tokens
    close(got, want)


def test_a_compiled_cached_step_refuses_what_needs_the_length_as_a_number():
    m = MultiHeadAttention(16, 2).eval()
    cache = KVCache(1, 8, m.num_kv_heads, m.head_dim)
    step = torch.compile(lambda x: m(x, cache=cache, need_weights=True), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="need_weights=True would need") as info:
        step(torch.randn(1, 1, 16))
    assert "torch.compile knows the cached length only as a tensor" in str(info.value)


def test_a_compiled_step_past_the_end_of_the_cache_fails_instead_of_writing_out_of_bounds():
    m = MultiHeadAttention(16, 2).eval()
    cache = KVCache(1, 3, m.num_kv_heads, m.head_dim)
    step = torch.compile(lambda x: m(x, cache=cache, is_causal=True), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            step(torch.randn(1, 1, 16))
        with pytest.raises((RuntimeError, IndexError), match="(?i)out of (bounds|range)"):
            step(torch.randn(1, 1, 16))
    assert cache.seq_len == 3


@pytest.mark.parametrize("strict", [False, True])
def test_an_exported_encoder_layer_runs_the_banded_kernel(strict):
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(32, 4, ffn_dim=64, dropout=0.0, dtype=torch.float64).eval()

    class Windowed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, key_mask):
            return self.layer(x, key_mask=key_mask, mask_mod=masks.window_mod(6, 6))

    x = torch.randn(2, 50, 32, dtype=torch.float64)
    key_mask = torch.ones(2, 50, dtype=torch.bool)
    key_mask[1, 37:] = False
    program = torch.export.export(Windowed(), (x, key_mask), strict=strict)
    ops = {str(n.target) for n in program.graph.nodes}
    assert "attnkit.band_forward.default" in ops
    x2 = torch.randn(2, 50, 32, dtype=torch.float64)
    close(program.module()(x2, key_mask), Windowed()(x2, key_mask))


def test_the_constant_mark_is_the_one_torch_sets():
    """attnkit marks its once-decided functions without importing torch._dynamo (start-up cost); the
    mark must stay the one torch's own decorator sets, or compiled calls would trace them."""
    from attnkit import _tracing
    from attnkit.backends import _fused

    def probe():
        return 0

    torch.compiler.assume_constant_result(probe)
    marked = [k for k in vars(probe)]
    assert marked == ["_dynamo_marked_constant"] and probe._dynamo_marked_constant is True
    for fn in (_band.available, _fused.available, _tracing.assume_constant_result(lambda: 1)):
        assert getattr(fn, "_dynamo_marked_constant", False) is True, fn


def test_eager_attention_without_gradients_does_not_import_the_compiler(tmp_path):
    """Importing attnkit and calling the banded kernel (no gradient) leaves torch._dynamo unimported:
    its import costs seconds every process would pay at its first call."""
    import subprocess
    import sys

    code = ("import sys, torch, attnkit\n"
            "q = torch.randn(1, 2, 64, 8)\n"
            "attnkit.attention(q, q, q, window=(4, 4))\n"
            "print(attnkit.which_backend(q, q, q, window=(4, 4)), 'torch._dynamo' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "ATTNKIT_BUILD": "0"})
    assert proc.returncode == 0, proc.stderr
    backend, imported = proc.stdout.split()
    assert imported == "False", (backend, proc.stderr)


def test_a_dispatch_mode_sees_the_banded_operator_even_without_gradients():
    """Eager calls without gradients skip the operator's dispatch, except while a dispatch mode is
    active: a mode (make_fx's, a profiler's, a user's) must see attnkit::band_forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if not _band.available():
        pytest.skip(f"banded kernel unavailable: {_band.unavailable_reason()}")

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 64, 8)
    assert attnkit.which_backend(q, q, q, window=(4, 4)) == "band"
    with torch.no_grad():
        want = attnkit.attention(q, q, q, window=(4, 4))
        with Seen() as seen:
            got = attnkit.attention(q, q, q, window=(4, 4))
    assert any("band_forward" in op for op in seen.ops), seen.ops[:20]
    assert torch.equal(got, want)


@pytest.mark.parametrize("causal", [False, True], ids=["no mask", "causal"])
def test_a_plain_bfloat16_call_traces_without_a_graph_break_wherever_auto_sends_it(causal):
    """Whether auto sends a plain bfloat16 call to the banded kernel depends on the CPU's flags and the kernel's
    products (_band.native_bf16_products), which are asked once while tracing, not traced: one graph, no
    break, and the compiled answer is the eager one (the same kernel; within the bfloat16 row should the
    compiler choose another route to SDPA's)."""
    q, k, v = (t.detach().to(torch.bfloat16) for t in _inputs(dtype=torch.float32))
    fn = lambda q, k, v: attnkit.attention(q, k, v, is_causal=causal)  # noqa: E731
    explained = torch._dynamo.explain(fn)(q, k, v)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    torch._dynamo.reset()
    close(torch.compile(fn, fullgraph=True)(q, k, v), fn(q, k, v), torch.bfloat16)
