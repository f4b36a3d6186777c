"""T5-style ``position_bias`` through transformers' "attnkit" attention: parity with transformers' own
attention on tiny random T5 and UMT5 models (logits, every parameter's gradient, greedy decoding), and the
three ways a ``position_bias`` is served (dropped zeros, a diagonal score_mod, a dense bias) against the
float64 formula.

T5's eager attention keeps the model's dtype through the softmax, so float64 is checked against both
"eager" and "sdpa"; float32 against "eager" within the model-parity row.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import attnkit  # noqa: E402
import attnkit.integrations.transformers as hf  # noqa: E402
from attnkit import scores  # noqa: E402
from attnkit.backends import _band  # noqa: E402
from tests.support import oracle  # noqa: E402
from tests.support.tolerances import MODEL_PARITY, close  # noqa: E402

V = 97
SMALL = dict(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def _model(cls=None, config_cls=None, dtype=torch.float32):
    torch.manual_seed(0)
    config = (config_cls or transformers.T5Config)(**SMALL)
    return (cls or transformers.T5ForConditionalGeneration)(config).to(dtype).eval()


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, V, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # right padding on one row of the encoder's input
    decoder_ids = torch.randint(2, V, (2, 7), generator=g)
    labels = torch.randint(2, V, (2, 7), generator=g)
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, labels=labels)


def _forward(model, impl, inputs):
    """Logits, and the loss's gradient for every parameter (by name), under ``impl``."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def test_t5_float32_logits_and_every_gradient_match_eager_and_the_bias_runs_as_a_diagonal():
    model = _model()
    inputs = _inputs()
    want, want_grads = _forward(model, "eager", inputs)
    with attnkit.backends.served() as names:
        got, got_grads = _forward(model, "attnkit", inputs)
    close(got, want, torch.float32, **MODEL_PARITY[torch.float32])
    assert set(got_grads) == set(want_grads)
    assert any("relative_attention_bias" in name for name in got_grads)
    for name, grad in want_grads.items():
        try:
            close(got_grads[name], grad, torch.float32, **MODEL_PARITY[torch.float32])
        except AssertionError as error:
            raise AssertionError(f"the gradient of {name}: {error}") from None
    # encoder self-attention x 2, then per decoder layer self- and cross-attention: the relative bias as the
    # banded kernel's diagonal table (a dense bias would go to sdpa), the cross-attention's zeros dropped
    assert _band.available(), _band.unavailable_reason()
    assert names == ["band"] * 6, names


def test_t5_float64_logits_match_sdpa_and_eager():
    model = _model(dtype=torch.float64)
    inputs = _inputs()
    del inputs["labels"]
    with torch.no_grad():
        results = {}
        for impl in ("sdpa", "eager", "attnkit"):
            model.set_attn_implementation(impl)
            results[impl] = model(**inputs).logits
    for anchor in ("sdpa", "eager"):
        close(results["attnkit"], results[anchor], torch.float64, **MODEL_PARITY[torch.float64])


def test_t5_greedy_generation_with_the_cache_matches_eager():
    """Cached decoding: each step one query whose bias row T5 computes at the cache's offset."""
    model = _model(dtype=torch.float64)
    inputs = _inputs()
    tokens = {}
    for impl in ("eager", "attnkit"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                      max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert tokens["eager"].shape[1] == 7
    assert torch.equal(tokens["attnkit"], tokens["eager"])


def test_umt5_a_relative_bias_in_every_layer_float32_matches_eager():
    model = _model(transformers.UMT5ForConditionalGeneration, transformers.UMT5Config)
    inputs = _inputs()
    del inputs["labels"]
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(**inputs).logits
        model.set_attn_implementation("attnkit")
        with attnkit.backends.served() as names:
            got = model(**inputs).logits
    close(got, want, torch.float32, **MODEL_PARITY[torch.float32])
    assert names == ["band"] * 6, names


class _Probe(torch.nn.Module):
    """A stand-in for the model's attention module (evaluation mode, not causal)."""

    is_causal = False


H, LQ, LK, E = 3, 5, 7, 4


def _qkv(batch=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, H, n, E, dtype=torch.float64, generator=g) for n in (LQ, LK, LK)]


def _toeplitz(table):
    """``[1, H, Lq, Lk]`` with cell ``(q, kv)`` = ``table[h, kv - q + Lq - 1]``: a bias per head and diagonal."""
    d = torch.arange(LK).view(1, -1) - torch.arange(LQ).view(-1, 1) + LQ - 1
    return table[:, d].unsqueeze(0)


def _through_forward(q, k, v, position_bias):
    """``hf.attnkit_attention_forward`` as transformers calls it, scaling 1 as T5's, back in ``[B, H, Lq, E]``;
    with the backends that served."""
    with attnkit.backends.served() as names:
        out, _ = hf.attnkit_attention_forward(_Probe().eval(), q, k, v, None, scaling=1.0,
                                              position_bias=position_bias)
    return out.transpose(1, 2), names


def test_a_toeplitz_bias_is_a_diagonal_score_mod_with_the_formulas_values_and_gradients():
    q, k, v = _qkv()
    table = torch.randn(H, LQ + LK - 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                        requires_grad=True)
    bias = _toeplitz(table)  # computed from the table, as T5's from its bucket embedding
    mod, dense = hf._position_bias_terms(bias, 2, H, LQ, LK)
    assert isinstance(mod, scores.DiagonalBias) and dense is None
    close(mod.diagonal(H, LQ, LK), table)
    out, names = _through_forward(q, k, v, bias)
    assert names == ["band"]
    want, _ = oracle.attention(q, k, v, bias=bias, scale=1.0)
    close(out, want)
    # the table's gradient (summed along each diagonal by the kernel) is the dense formula's
    (got_grad,) = torch.autograd.grad(out.square().sum(), table)
    s = q @ k.transpose(-1, -2) + _toeplitz(table)
    (want_grad,) = torch.autograd.grad((torch.softmax(s, -1) @ v).square().sum(), table)
    close(got_grad, want_grad)
    # every batch row the same: still one value per head and diagonal
    mod, dense = hf._position_bias_terms(bias.expand(2, -1, -1, -1), 2, H, LQ, LK)
    assert isinstance(mod, scores.DiagonalBias) and dense is None


@pytest.mark.parametrize("case", ["per batch row", "not per diagonal", "a leaf requiring grad"])
def test_any_other_bias_is_the_dense_bias_with_the_formulas_values(case):
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(3)
    if case == "per batch row":
        table = torch.randn(H, LQ + LK - 1, dtype=torch.float64, generator=g)
        bias = torch.cat([_toeplitz(table), _toeplitz(table.flip(-1))])
    elif case == "not per diagonal":
        bias = _toeplitz(torch.randn(H, LQ + LK - 1, dtype=torch.float64, generator=g)).clone()
        bias[0, 1, 3, 4] += 1.0  # one cell off its diagonal
    else:  # Toeplitz values, but its own gradient must be per cell
        bias = torch.zeros(1, H, LQ, LK, dtype=torch.float64, requires_grad=True)
    mod, dense = hf._position_bias_terms(bias, 2, H, LQ, LK)
    assert mod is None and dense is bias
    out, names = _through_forward(q, k, v, bias)
    assert names and names != ["band"]
    want, _ = oracle.attention(q, k, v, bias=bias, scale=1.0)
    close(out, want)
    if bias.requires_grad:
        (got_grad,) = torch.autograd.grad(out.square().sum(), bias)
        (want_grad,) = torch.autograd.grad((torch.softmax(q @ k.transpose(-1, -2) + bias, -1) @ v).square().sum(),
                                           bias)
        close(got_grad, want_grad)


def test_zeros_that_need_no_gradient_are_dropped():
    q, k, v = _qkv()
    zeros = torch.zeros(1, H, LQ, LK, dtype=torch.float64)
    assert hf._position_bias_terms(zeros, 2, H, LQ, LK) == (None, None)
    out, _ = _through_forward(q, k, v, zeros)
    close(out, oracle.attention(q, k, v, scale=1.0)[0])


def test_the_verdict_is_checked_once_per_tensor_and_again_after_an_in_place_write(monkeypatch):
    checked = []
    classify = hf._classify
    monkeypatch.setattr(hf, "_classify", lambda t: checked.append(t) or classify(t))
    bias = _toeplitz(torch.randn(H, LQ + LK - 1, dtype=torch.float64))
    for _ in range(3):  # as the layers of one stack are handed the same tensor
        assert isinstance(hf._position_bias_terms(bias, 2, H, LQ, LK)[0], scores.DiagonalBias)
    assert len(checked) == 1
    bias[0, 0, 2, 2] += 1.0  # in place: the version moves on, and the tensor is no longer Toeplitz
    assert hf._position_bias_terms(bias, 2, H, LQ, LK) == (None, bias)
    assert len(checked) == 2
    model = _model()
    inputs = _inputs()
    del inputs["labels"]
    model.set_attn_implementation("attnkit")
    checked.clear()
    with torch.no_grad():
        model(**inputs)
    # one tensor each for the encoder's and the decoder's self-attention, one of zeros for the cross-attention
    assert len(checked) == 3


def test_sinks_and_a_capped_position_bias_are_refused_and_a_position_bias_must_be_a_float_tensor():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"_Probe.*'sinks'"):
        hf.attnkit_attention_forward(_Probe(), q, k, v, None, sinks=torch.zeros(H))
    with pytest.raises(ValueError, match=r"_Probe.*'softcap'"):
        hf.attnkit_attention_forward(_Probe(), q, k, v, None, softcap=5.0, position_bias=torch.zeros(1, H, LQ, LK))
    with pytest.raises(TypeError, match="position_bias must be a floating-point tensor"):
        hf.attnkit_attention_forward(_Probe(), q, k, v, None, position_bias=torch.zeros(1, H, LQ, LK, dtype=torch.long))


def test_the_verdicts_cache_is_safe_under_threads():
    """Threads released together classify one shared tensor and fresh ones that die at once (their cache
    entries go while others are written), each thread also writing its own tensor in place: every
    verdict is the tensor's."""
    from tests.support.racing import race

    table = torch.randn(H, LQ + LK - 1, dtype=torch.float64)
    shared = _toeplitz(table)
    mine = [_toeplitz(table).clone() for _ in range(4)]

    def body(me, together):
        for n in range(60):
            if n % 20 == 0:
                together()
            assert isinstance(hf._position_bias_terms(shared, 2, H, LQ, LK)[0], scores.DiagonalBias)
            fresh = _toeplitz(table) if n % 2 else torch.randn(1, H, LQ, LK, dtype=torch.float64)
            assert (hf._position_bias_terms(fresh, 2, H, LQ, LK)[1] is None) == bool(n % 2)
            mine[me][0, 0, 1, 1] += 1.0 if n % 2 else -1.0  # Toeplitz again after every second write
            assert (hf._position_bias_terms(mine[me], 2, H, LQ, LK)[1] is None) == (n % 2 == 1)

    race(body, 4, 1e-6)
