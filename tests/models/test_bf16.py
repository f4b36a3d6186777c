"""Modules, models and cached decoding in bfloat16 end to end (``model.to(torch.bfloat16)``).

Each bfloat16 module or model is compared with its float64 twin: the same module with its bfloat16
weights cast up (exactly), run on the same bfloat16-rounded inputs, so the difference is what the
bfloat16 arithmetic costs (every layer's, not only the attention's), held to the tolerance table's
bfloat16 row. Every test also records which backend served each attention call (a spy on
``attnkit.backends.select``) and checks it is where ``"auto"`` sends such a call made on its own
(:func:`attnkit.which_backend`): the models keep their causal calls plain (no mask built for them), so the
banded kernel serves them wherever ``BandBackend.prefers`` puts it ahead of SDPA.

The tiny models keep their values of order one (GPT-2's weights drawn with std 0.1, logits up to about 2),
the size the bfloat16 row is for: the row bounds outputs of order one, and a model's bfloat16 error grows
with its values and its depth (with std 0.3 weights, logits up to about 7, the logits' error was about 1% of
the largest logit, above the row's absolute part for the small ones; SDPA's bfloat16 path errs as much).
"""

from __future__ import annotations

import copy

import pytest
import torch

from attnkit import _cpu, backends, which_backend
from attnkit.backends import _band
from attnkit.cache import KVCache
from attnkit.models import GPT2, Bert, BertConfig, GPT2Config
from attnkit.modules import MultiHeadAttention, Transformer, TransformerDecoderLayer, TransformerEncoderLayer
from tests.support.backends import half_products
from tests.support.tolerances import TOLERANCES, close

BF16 = torch.bfloat16
VOCAB = 101


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert _band.available(), _band.unavailable_reason()


def causal(q_len: int, kv_len: int | None = None) -> str:
    """Where ``"auto"`` sends a plain causal bfloat16 call without gradient: ``q_len`` queries, ``kv_len`` keys."""
    q = torch.zeros(1, 4, q_len, 8, dtype=BF16)
    k = torch.zeros(1, 4, q_len if kv_len is None else kv_len, 8, dtype=BF16)
    return which_backend(q, k, k, is_causal=True)


def test_causal_bfloat16_calls_go_to_the_kernel():
    """The rule the models' tests lean on: the kernel serves plain causal calls of more than one query ahead of
    SDPA (one query, a decode step without a gradient, goes to the decode kernel)."""
    if not _band.available():
        pytest.skip(f"no banded kernel here: {_band.unavailable_reason()}")
    assert causal(37) == "band" and causal(1, 37) == "decode"


def plain(q_len: int, kv_len: int | None = None, dtype: torch.dtype = BF16) -> str:
    """Where ``"auto"`` sends a bfloat16 (or ``dtype``) call with no mask: ``q_len`` queries, ``kv_len`` keys."""
    q = torch.zeros(1, 4, q_len, 8, dtype=dtype)
    k = torch.zeros(1, 4, q_len if kv_len is None else kv_len, 8, dtype=dtype)
    return which_backend(q, k, k)


def test_bfloat16_calls_without_a_mask_go_to_the_kernel_where_it_runs_the_cpus_bfloat16_products():
    """Where the kernel's bfloat16 products are the CPU's own (oneDNN's brgemm on a CPU with AVX512-BF16, no AMX),
    plain bfloat16 calls of more than one query go to it ahead of SDPA, whose CPU kernel does not use them; with
    the products off, or elsewhere, SDPA keeps them, and float32 calls stay with SDPA everywhere (a few queries go
    to the decode kernel)."""
    native = _band.native_bf16_products()
    assert native == (_cpu.has_bf16_products() and _band.half_products(BF16)
                      and _band._module().bf16_gemm() == "oneDNN brgemm")
    assert plain(37) == ("band" if native else "sdpa")
    assert plain(5, 37) == ("band" if native else "decode")  # a few queries without a gradient: the decode kernel
    assert plain(1, 37) == "decode"
    assert plain(37, dtype=torch.float32) == "sdpa"
    with half_products(BF16, False):
        assert plain(37) == "sdpa"


def twins(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``module`` in bfloat16, and its float64 twin with the same (bfloat16) weights."""
    low = module.eval().to(BF16)
    return low, copy.deepcopy(low).to(torch.float64)


def bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


# ---------------------------------------------------------------- modules


@pytest.mark.parametrize("case", ["causal", "causal GQA", "window", "no mask", "key padding", "cross"])
@torch.no_grad()
def test_multihead_attention_in_bfloat16_matches_float64(case):
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2 if case == "causal GQA" else None)
    with torch.no_grad():  # the biases start at zero: make them count
        for p in mha.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    low, high = twins(mha)
    x, memory = bf16(2, 37, 32), bf16(2, 11, 32, seed=1)
    key_mask = torch.ones(2, 37, dtype=torch.bool)
    key_mask[1, 20:] = False
    args, kw, want = {
        "causal": ((x,), {"is_causal": True}, causal(37)),
        "causal GQA": ((x,), {"is_causal": True}, causal(37)),
        "window": ((x,), {"window": (5, 5)}, "band"),
        "no mask": ((x,), {}, plain(37)),
        "key padding": ((x,), {"key_mask": key_mask}, "sdpa"),
        "cross": ((x, memory), {}, plain(37, 11)),
    }[case]
    with backends.served() as ran:
        out = low(*args, **kw)
    assert ran == [want]
    assert out.dtype == BF16
    close(out, high(*(a.double() for a in args), **kw), BF16)


@torch.no_grad()
@pytest.mark.parametrize("products", [True, False], ids=["bf16 products", "float32 products"])
def test_the_kernel_with_either_products_stays_within_the_row(products):
    """The kernel computes bfloat16 inputs with bfloat16 products (where the CPU has them, or asked) or with
    float32 products: the same module through it stays within the bfloat16 row either way."""
    torch.manual_seed(0)
    low, high = twins(MultiHeadAttention(32, 4))
    x = bf16(2, 37, 32)
    with half_products(torch.bfloat16, products), backends.served() as ran:
        out = low(x, is_causal=True, backend="band")
    assert ran == ["band"]
    close(out, high(x.double(), is_causal=True), BF16)


LAYERS = {  # case: (build the module, whether it reads (src, tgt) rather than one sequence, keywords)
    "pre-norm causal encoder layer": (
        lambda: TransformerEncoderLayer(32, 4, ffn_dim=64, dropout=0.0, norm_first=True), False, {"is_causal": True}),
    "post-norm padded encoder layer": (
        lambda: TransformerEncoderLayer(32, 4, ffn_dim=64, dropout=0.0), False, {"key_mask": "padding"}),
    "decoder layer": (lambda: TransformerDecoderLayer(32, 4, ffn_dim=64, dropout=0.0), True, {}),
    "encoder-decoder": (
        lambda: Transformer(32, 4, num_encoder_layers=1, num_decoder_layers=1, ffn_dim=64, dropout=0.0), True, {}),
}


@pytest.mark.parametrize("case", list(LAYERS))
@torch.no_grad()
def test_transformer_layers_in_bfloat16_match_float64(case):
    """One layer of each kind, and a one-plus-one-layer encoder-decoder. Each layer's bfloat16 arithmetic adds
    its own rounding: two encoder and two decoder layers came to 0.6-1.1 of the row over three seeds, as much
    through SDPA or the reference backend as through the kernel, so deeper stacks are not held to it here."""
    build, pair, kw = LAYERS[case]
    torch.manual_seed(0)
    low, high = twins(build())
    src, tgt = bf16(2, 11, 32, seed=1), bf16(2, 13, 32)
    if kw.get("key_mask") == "padding":
        kw = {"key_mask": torch.arange(13) < torch.tensor([[13], [9]])}
    args = (src, tgt) if case == "encoder-decoder" else (tgt, src) if pair else (tgt,)
    with backends.served() as ran:
        out = low(*args, **kw)
    want = {"pre-norm causal encoder layer": [causal(13)], "post-norm padded encoder layer": ["sdpa"],
            "decoder layer": [causal(13), plain(13, 11)],
            "encoder-decoder": [plain(11), causal(13), plain(13, 11)]}[case]
    assert ran == want
    assert out.dtype == BF16
    close(out, high(*(a.double() for a in args), **kw), BF16)


@torch.no_grad()
def test_decoder_layer_cached_steps_in_bfloat16_equal_its_full_forward():
    torch.manual_seed(0)
    low, _ = twins(TransformerDecoderLayer(32, 4, ffn_dim=64, dropout=0.0))
    tgt, memory = bf16(2, 13, 32), bf16(2, 7, 32, seed=1)
    full = low(tgt, memory)
    cache = KVCache(2, 13, 4, 8, dtype=BF16)
    with backends.served() as ran:
        steps = [low(tgt[:, :5], memory, cache=cache)] + [low(tgt[:, t:t + 1], memory, cache=cache)
                                                          for t in range(5, 13)]
    # each call: the causal self-attention over what is cached, then the cross-attention
    assert ran == [x for t in range(5, 14) for x in (causal(5 if t == 5 else 1, t), plain(5 if t == 5 else 1, 7))]
    close(torch.cat(steps, dim=1), full, BF16)


# ---------------------------------------------------------------- models


def tiny_gpt2(std: float, seed: int = 0) -> GPT2:
    """A seeded two-layer GPT-2 (E = 32, 4 heads, 101 tokens), its matrices drawn with ``std``."""
    torch.manual_seed(seed)
    model = GPT2(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, eos_token_id=None))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    return model


@pytest.fixture(scope="module")
def gpt2():
    """The bfloat16 model and its float64 twin; std 0.1 keeps the logits of order one."""
    return twins(tiny_gpt2(0.1))


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_gpt2_in_bfloat16_matches_float64(gpt2, prompts):
    low, high = gpt2
    with backends.served() as ran:
        logits = low(prompts).logits
    assert ran == [causal(9)] * 2
    assert logits.dtype == BF16
    want = high(prompts).logits
    close(logits, want, BF16)
    # The kernel adds no error of its own beyond SDPA's: the same bfloat16 model through SDPA errs as much.
    sdpa = copy.deepcopy(low).set_backend("sdpa")(prompts).logits
    err, sdpa_err = ((t.double() - want).abs().max().item() for t in (logits, sdpa))
    assert err <= 1.5 * sdpa_err, (err, sdpa_err)


@torch.no_grad()
def test_gpt2_cached_decoding_in_bfloat16_equals_its_full_forward(gpt2, prompts):
    """A prefill of 4 tokens, then one token at a time, on a bfloat16 KV cache: each step's logits are
    the bfloat16 full forward's within the bfloat16 row."""
    low, _ = gpt2
    full = low(prompts).logits
    cache = low.make_cache(3, 9)
    assert all(c.k.dtype == BF16 for c in cache)
    with backends.served() as ran:
        steps = [low(prompts[:, :4], cache=cache).logits]
        steps += [low(prompts[:, t:t + 1], cache=cache).logits for t in range(4, 9)]
    assert ran == [causal(4)] * 2 + [causal(1, t) for t in range(5, 10) for _ in range(2)]
    close(torch.cat(steps, dim=1), full, BF16)


@pytest.mark.parametrize("std", [0.1, 0.3])
def test_gpt2_greedy_in_bfloat16_follows_float32_up_to_a_near_tie(std, prompts):
    """Greedy tokens of the bfloat16 model against the same model in float32. They agree until float32's
    top token and bfloat16's are closer under float32 than the bfloat16 row allows at that step
    (``2 * (atol + rtol * max|logit|)``): then either may win, and the two runs go on from different
    contexts. Which prompts part, and where, follows the near-ties and the backends' rounding: measured here
    over three seeds each of std 0.1, 0.3 and 0.5, 5 of 27 prompts parted within 12 tokens, each where
    float32's two candidates were 0.0003 to 0.033 apart, against allowances of 0.085 to 0.28."""
    low, _ = twins(tiny_gpt2(std))
    single = copy.deepcopy(low).float()
    new = 12
    with backends.served() as ran:
        ours = low.generate(prompts, new)
    assert ran == [causal(9)] * 2 + [causal(1, t) for t in range(10, 9 + new) for _ in range(2)]
    theirs = single.generate(prompts, new)
    assert torch.equal(ours[:, :9], prompts)
    assert len(set(theirs[:, 9:].flatten().tolist())) > 3, "degenerate model: the test would prove little"
    with torch.no_grad():
        logits = single(theirs[:, :-1]).logits[:, 8:].double()  # float32's logits for each of its tokens
    tol = TOLERANCES[BF16]
    for row in range(len(prompts)):
        differ = (ours[row, 9:] != theirs[row, 9:]).nonzero()
        if not len(differ):
            continue
        step = int(differ[0])
        step_logits = logits[row, step]
        gap = step_logits[theirs[row, 9 + step]] - step_logits[ours[row, 9 + step]]
        allowed = 2 * (tol["atol"] + tol["rtol"] * step_logits.abs().max())
        assert 0 <= gap <= allowed, (row, step, gap.item(), allowed.item())


@pytest.mark.parametrize("backend", ["auto", "band"])
@torch.no_grad()
def test_bert_in_bfloat16_matches_float64_on_a_padded_batch(backend):
    """BERT in bfloat16 on a right-padded batch: "auto" gives padding to SDPA as a dense mask, "band" reads
    it as one interval per row (``padding_mod``)."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    low, high = twins(Bert(config, backend=backend))
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    real = torch.ones_like(ids)
    real[1, 7:] = 0
    real[2, 3:] = 0
    with backends.served() as ran:
        out = low(ids, attention_mask=real)
    assert ran == ["sdpa" if backend == "auto" else "band"] * 2
    want = high(ids, attention_mask=real)
    keep = real.bool()
    assert out.last_hidden_state.dtype == BF16
    close(out.last_hidden_state[keep], want.last_hidden_state[keep], BF16)
    close(out.pooler_output, want.pooler_output, BF16)
