"""attnkit.models.GPT2 against transformers' GPT2LMHeadModel (small random configs, no download)."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attnkit.models import GPT2  # noqa: E402
from tests.support.backends import eager_backends  # noqa: E402
from tests.support.tolerances import MODEL_PARITY, close  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB = 101


def _hf_gpt2(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides):
    # A wide initialisation makes the random model's next token depend on its context, so greedy
    # decoding does not collapse into one repeated token and the comparison means something.
    kw = dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=3, n_head=4, initializer_range=0.5,
              bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    kw.update(overrides)
    cfg = transformers.GPT2Config(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).to(dtype).eval()


@functools.cache
def _pair(dtype: torch.dtype):
    hf = _hf_gpt2(dtype=dtype)
    return hf, GPT2.from_hf(hf)


@pytest.fixture(scope="module")
def pair():
    """float64: both models round at ~1e-16, so parity (and every greedy token) holds on any CPU.

    In float32 the two differ by operation order, which depends on the CPU, BLAS and thread count;
    the float32 checks use the measured rows in ``tests/support/tolerances.py``.
    """
    return _pair(torch.float64)


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, VOCAB - 1, (3, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@torch.no_grad()
def test_logits_and_weights_match_transformers(dtype, prompts):
    hf, gpt = _pair(dtype)
    r = hf(prompts, output_attentions=True)
    o = gpt(prompts, output_attentions=True)
    assert o.logits.shape == (3, 9, VOCAB) and o.logits.dtype == dtype
    close(o.logits, r.logits, **MODEL_PARITY[dtype])
    assert len(o.attentions) == len(r.attentions) == 3
    for a, b in zip(o.attentions, r.attentions, strict=True):
        close(a, b, **MODEL_PARITY[dtype])


@torch.no_grad()
def test_right_padding_mask_matches_transformers(pair, prompts):
    hf, gpt = pair
    am = torch.ones_like(prompts)
    am[1, 6:] = 0
    am[2, 3:] = 0
    r = hf(prompts, attention_mask=am).logits
    o = gpt(prompts, attention_mask=am).logits
    real = am.bool()
    close(o[real], r[real])


@pytest.mark.parametrize("overrides", [
    {"activation_function": "relu", "n_inner": 48, "scale_attn_by_inverse_layer_idx": True},
    {"scale_attn_weights": False, "layer_norm_epsilon": 1e-3},
])
@torch.no_grad()
def test_config_variants_match_transformers(overrides, prompts):
    hf = _hf_gpt2(seed=3, **overrides)
    close(GPT2.from_hf(hf)(prompts).logits, hf(prompts).logits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@torch.no_grad()
def test_cached_prefill_and_steps_equal_full_forward(dtype, prompts):
    _, gpt = _pair(dtype)
    full = gpt(prompts).logits
    cache = gpt.make_cache(3, 9)
    parts = [gpt(prompts[:, :4], cache=cache).logits]
    for t in range(4, 9):
        parts.append(gpt(prompts[:, t:t + 1], cache=cache).logits)
    assert cache[0].seq_len == 9
    close(torch.cat(parts, dim=1), full, **MODEL_PARITY[dtype])


def test_greedy_generation_equals_transformers_and_uncached_loop(pair, prompts):
    hf, gpt = pair
    cached = gpt.generate(prompts, max_new_tokens=24, use_cache=True)
    uncached = gpt.generate(prompts, max_new_tokens=24, use_cache=False)
    ref = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=24, do_sample=False)
    assert cached.shape == (3, 33)
    assert torch.equal(cached[:, :9], prompts)
    assert len(set(cached[:, 9:].flatten().tolist())) > 3, "degenerate model: the test would prove little"
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, ref)


def test_left_padded_batch_generation(pair, prompts):
    """Prompts of lengths 9, 6, 3 padded on the left: transformers' tokens, and each row's tokens alone."""
    hf, gpt = pair
    am = torch.ones_like(prompts)
    am[1, :3] = 0
    am[2, :6] = 0
    ids = prompts.masked_fill(am == 0, 7)
    cached = gpt.generate(ids, 16, attention_mask=am)
    uncached = gpt.generate(ids, 16, attention_mask=am, use_cache=False)
    ref = hf.generate(ids, attention_mask=am, max_new_tokens=16, do_sample=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, ref)
    for row, start in ((1, 3), (2, 6)):
        alone = gpt.generate(ids[row:row + 1, start:], 16)
        assert torch.equal(alone[0, 9 - start:], cached[row, 9:])


@pytest.mark.parametrize("padded", [False, True])
def test_compiled_generation_gives_the_same_tokens_and_compiles_once(pair, prompts, padded):
    """``generate(compile=...)``: the steps after the prompt run as one compiled graph (aot_eager
    here, which traces as inductor does, without its C++ build), with the same tokens as eager
    decoding and transformers; a second call with the same sizes compiles nothing more."""
    from torch._dynamo.utils import counters

    hf, gpt = pair
    am = torch.ones_like(prompts)
    if padded:
        am[1, :3] = 0
        am[2, :6] = 0
    ids = prompts.masked_fill(am == 0, 7)
    mask = am if padded else None  # without a mask the positions are the cache's
    torch._dynamo.reset()
    first = gpt.generate(ids, 16, attention_mask=mask, compile="aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    again = gpt.generate(ids, 16, attention_mask=mask, compile="aot_eager")
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled for the second call
    ref = hf.generate(ids, attention_mask=am, max_new_tokens=16, do_sample=False)
    assert torch.equal(first, gpt.generate(ids, 16, attention_mask=mask))
    assert torch.equal(first, again) and torch.equal(first, ref)
    with pytest.raises(ValueError, match="compile needs use_cache=True"):
        gpt.generate(ids, 4, use_cache=False, compile=True)
    torch._dynamo.reset()


def test_eos_stops_and_pads_like_transformers(pair, prompts):
    hf, gpt = pair
    free = gpt.generate(prompts, max_new_tokens=12)
    eos = int(free[1, 9 + 4])  # a token that row 1 emits part-way through
    ours = gpt.generate(prompts, max_new_tokens=12, eos_token_id=eos)
    ref = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12, do_sample=False,
                      eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(ours, ref)
    assert (ours[1, 9:] == eos).sum() >= 1


def test_sampling_is_reproducible_and_in_top_k(pair, prompts):
    _, gpt = pair
    a = gpt.generate(prompts, max_new_tokens=8, do_sample=True, top_k=3, generator=torch.Generator().manual_seed(0))
    b = gpt.generate(prompts, max_new_tokens=8, do_sample=True, top_k=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    with torch.no_grad():
        logits = gpt(a[:, :-1]).logits[:, 8:]  # the distributions each sampled token came from
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == a[:, 9:, None]).any(-1).all()


@pytest.mark.parametrize("backend", eager_backends())
@torch.no_grad()
def test_every_backend_model_wide(backend, pair, prompts):
    hf, _ = pair
    gpt = GPT2.from_hf(hf, backend=backend)
    close(gpt(prompts).logits, hf(prompts).logits)
    w = gpt(prompts, output_attentions=True).attentions  # weights: the reference serves this pass
    assert w[0].shape == (3, 4, 9, 9)
    assert torch.equal(gpt.generate(prompts, max_new_tokens=6), gpt.generate(prompts, 6, use_cache=False))


@torch.no_grad()
def test_from_pretrained_local_folder(pair, prompts, tmp_path):
    hf, _ = pair
    hf.save_pretrained(tmp_path)
    logits = GPT2.from_pretrained(tmp_path)(prompts).logits  # float32 by default; hf is the float64 truth
    assert logits.dtype == torch.float32
    close(logits, hf(prompts).logits, **MODEL_PARITY[torch.float32])
    close(GPT2.from_pretrained(tmp_path, dtype=torch.float64)(prompts).logits, hf(prompts).logits)


def test_bad_arguments(pair, prompts):
    _, gpt = pair
    with pytest.raises(ValueError, match="input_ids must be an integer"):
        gpt(prompts.float())
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 101\)"):
        gpt(prompts + VOCAB)
    with pytest.raises(ValueError, match="exceed n_positions"):
        gpt.generate(prompts, max_new_tokens=60)
    with pytest.raises(ValueError, match="max_new_tokens must be"):
        gpt.generate(prompts, max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, T\]"):
        gpt(prompts, attention_mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"position_ids must lie in \[0, 64\)"):
        gpt(prompts, position_ids=torch.arange(60, 69))
    with pytest.raises(ValueError, match=r"position_ids must be an integer \[B, L\] = \(3, 9\)"):
        gpt(prompts, position_ids=torch.arange(4))
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, L\] = \(3, 9\) like input_ids"):
        gpt.generate(prompts, 2, attention_mask=torch.ones(3, 8))
    with pytest.raises(ValueError, match="cache must be a list of 3 KVCache"):
        gpt(prompts, cache=gpt.make_cache(3, 9)[:1])
    with pytest.raises(TypeError, match="transformers GPT2LMHeadModel"):
        GPT2.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="'add_cross_attention' is set"):
        GPT2.from_hf(_hf_gpt2(add_cross_attention=True))


@settings(max_examples=10)
@given(split=st.integers(1, 8), steps=st.integers(1, 4), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_any_prefill_split_equals_full_forward(pair, split, steps, seed):
    """Property: prefill ``split`` tokens, then feed chunks of ``steps``: the logits of the full pass."""
    _, gpt = pair
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    cache = gpt.make_cache(2, 9)
    parts = [gpt(ids[:, :split], cache=cache).logits]
    for t in range(split, 9, steps):
        parts.append(gpt(ids[:, t:t + steps], cache=cache).logits)
    close(torch.cat(parts, dim=1), gpt(ids).logits)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), cut=st.integers(1, 8))
@torch.no_grad()
def test_future_tokens_never_change_earlier_logits(pair, seed, cut):
    _, gpt = pair
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, VOCAB, (1, 9), generator=g)
    b = a.clone()
    b[:, cut:] = torch.randint(0, VOCAB, (1, 9 - cut), generator=g)
    close(gpt(b).logits[:, :cut], gpt(a).logits[:, :cut])
