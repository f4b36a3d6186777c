"""The static KV cache, and cached decoding through MultiHeadAttention equal to the full forward."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit.cache import KVCache, visible
from attnkit.memory import MAX_DENSE_BYTES_ENV
from attnkit.modules import MultiHeadAttention
from attnkit.modules import attention as attention_module
from attnkit.positional import ALiBi, RelativeKeyEmbedding, RotaryEmbedding, T5RelativeBias
from tests.support.backends import eager_backends
from tests.support.tolerances import close


def test_update_writes_in_place_at_cache_pos_and_returns_the_buffers():
    c = KVCache(2, 6, 3, 4, v_head_dim=5)
    k_buf, v_buf = c.k.data_ptr(), c.v.data_ptr()
    k1, v1 = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 5)
    k, v, length, n = c.update(k1, v1)
    assert (k.shape, v.shape) == ((2, 3, 6, 4), (2, 3, 6, 5))
    assert c.seq_len == n == 2 and int(c.cache_pos) == int(length) == 2 and c.cache_pos.dim() == 0
    k2, v2 = torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 5)
    k, v, length, n = c.update(k2, v2)
    assert c.seq_len == n == 5 and int(c.cache_pos) == int(length) == 5
    assert torch.equal(k[:, :, :5], torch.cat([k1, k2], dim=2)) and torch.equal(v[:, :, :5], torch.cat([v1, v2], dim=2))
    assert torch.equal(k[:, :, 5:], torch.zeros(2, 3, 1, 4))  # the tail is not written
    # Static: same storage, and the returned tensors are the buffers (no reallocation per token).
    assert c.k.data_ptr() == k_buf and c.v.data_ptr() == v_buf and k.data_ptr() == k_buf and v.data_ptr() == v_buf
    c.reset()
    assert c.seq_len == 0 and int(c.cache_pos) == 0
    k, *_ = c.update(k2, v2)
    assert torch.equal(k[:, :, :3], k2)


def test_update_returns_the_same_shapes_at_every_token():
    """Fixed shapes: what a compiled or graph-captured step sees does not change with the position."""
    c = KVCache(2, 7, 2, 4, v_head_dim=3, dtype=torch.float64)
    seen, written = set(), []
    for step in range(7):
        k, v = torch.randn(2, 2, 1, 4, dtype=torch.float64), torch.randn(2, 2, 1, 3, dtype=torch.float64)
        written.append(k)
        out = c.update(k, v)
        seen.add((tuple(out.k.shape), tuple(out.v.shape), tuple(out.length.shape), out.k.data_ptr()))
        assert int(out.length) == out.seq_len == step + 1
    assert seen == {((2, 2, 7, 4), (2, 2, 7, 3), (), c.k.data_ptr())}
    assert torch.equal(c.k, torch.cat(written, dim=2))


@pytest.mark.parametrize("causal", [False, True])
def test_visible_allows_written_keys_only_aligned_to_the_written_length(causal):
    from attnkit.cache import visible

    c = KVCache(1, 8, 1, 2)
    c.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    cached = c.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))  # queries at positions 3 and 4
    expected = torch.zeros(2, 8, dtype=torch.bool)
    expected[:, :5] = True
    if causal:
        expected[0, 4] = False  # query at 3 may not see key 4
    seen = visible(cached, 2, causal=causal)
    assert seen.shape == (1, 1, 2, 8) and torch.equal(seen[0, 0], expected)


def test_overflow_and_bad_shapes_raise_naming_sizes():
    c = KVCache(1, 4, 2, 8)
    c.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match=r"3 cached \+ 2 new tokens > max_len 4"):
        c.update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))
    assert c.seq_len == 3  # a refused update changes nothing
    with pytest.raises(ValueError, match=r"k must be \[B, Hkv, L, D\] = \[1, 2, L, 8\], got \(1, 3, 1, 8\)"):
        c.update(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8))
    with pytest.raises(TypeError, match="dtype"):
        c.update(torch.zeros(1, 2, 1, 8, dtype=torch.float64), torch.zeros(1, 2, 1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        KVCache(1, 0, 2, 8)


def test_cache_is_not_in_state_dict_and_moves_with_to():
    c = KVCache(1, 4, 2, 8)
    assert c.state_dict() == {}
    c = c.to(torch.float64)
    assert c.k.dtype == torch.float64 and c.cache_pos.dtype == torch.long


def _decode_in_chunks(mha, x, chunks, cache, **kw):
    outs, start = [], 0
    for n in chunks:
        outs.append(mha(x[:, start:start + n], cache=cache, **kw))
        start += n
    return torch.cat(outs, dim=1)


POSITIONS = {
    "none": lambda h, d: {},
    "rope_half": lambda h, d: {"rotary": RotaryEmbedding(d)},
    "rope_interleaved": lambda h, d: {"rotary": RotaryEmbedding(d, interleaved=True)},
    "alibi": lambda h, d: {"position_bias": ALiBi(h)},
    "t5_causal": lambda h, d: {"position_bias": T5RelativeBias(h, num_buckets=8, max_distance=16,
                                                               bidirectional=False)},
    "relative_key": lambda h, d: {"position_bias": RelativeKeyEmbedding(3, d)},
}


@pytest.mark.parametrize("kind", sorted(POSITIONS))
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_cached_decoding_equals_full_forward(kind, num_kv_heads):
    torch.manual_seed(0)
    b, length, e, h = 2, 9, 32, 4
    d = e // h
    mha = MultiHeadAttention(e, h, num_kv_heads=num_kv_heads, **POSITIONS[kind](h, d)).double().eval()
    if kind.startswith("t5"):
        torch.nn.init.normal_(mha.position_bias.relative_attention_bias.weight)
    if kind == "relative_key":
        torch.nn.init.normal_(mha.position_bias.distance_embedding.weight)
    x = torch.randn(b, length, e, dtype=torch.float64)
    full = mha(x, is_causal=True)
    cache = KVCache(b, 16, num_kv_heads, d, dtype=torch.float64)
    # A prompt of 4, then single tokens, then a chunk of 2 (Lq != Lk, bottom-right causal).
    inc = _decode_in_chunks(mha, x, [4, 1, 1, 2, 1], cache, is_causal=True)
    close(inc, full)
    assert cache.seq_len == length


def test_cached_decoding_with_key_mask_and_padding():
    torch.manual_seed(1)
    b, length, e, h = 2, 6, 16, 2
    mha = MultiHeadAttention(e, h, rotary=RotaryEmbedding(8)).double().eval()
    x = torch.randn(b, length, e, dtype=torch.float64)
    key_mask = torch.ones(b, length, dtype=torch.bool)
    key_mask[1, :2] = False  # left padding in the second row
    full = mha(x, is_causal=True, key_mask=key_mask)
    cache = KVCache(b, length, h, 8, dtype=torch.float64)
    outs = [mha(x[:, :3], cache=cache, is_causal=True, key_mask=key_mask[:, :3])]
    for t in range(3, length):
        outs.append(mha(x[:, t:t + 1], cache=cache, is_causal=True, key_mask=key_mask[:, :t + 1]))
    close(torch.cat(outs, 1)[1, 2:], full[1, 2:])
    close(torch.cat(outs, 1)[0], full[0])


@pytest.mark.parametrize("backend", eager_backends())
def test_cached_decoding_on_every_backend_with_masks_bias_and_window(backend):
    """The cache's whole buffers with its visibility mask: every backend serves the call, and a
    dense mask, a bias and a window over the cached keys give the rows of the full pass."""
    torch.manual_seed(3)
    b, length, e, h = 2, 7, 16, 2
    mha = MultiHeadAttention(e, h, rotary=RotaryEmbedding(8), backend=backend).double().eval()
    x = torch.randn(b, length, e, dtype=torch.float64)
    key_mask = torch.ones(b, length, dtype=torch.bool)
    key_mask[1, 3] = False
    bias = torch.randn(b, h, length, length, dtype=torch.float64) if backend != "band" else None  # band: no dense bias
    window = (2, 0) if backend != "sdpa" else None  # SDPA takes no window
    full = mha(x, is_causal=True, key_mask=key_mask, bias=bias, window=window)
    cache = KVCache(b, 10, h, 8, dtype=torch.float64)  # longer than needed: an unwritten tail throughout
    outs, start = [], 0
    for n in (3, 1, 2, 1):
        stop = start + n
        outs.append(mha(x[:, start:stop], cache=cache, is_causal=True, key_mask=key_mask[:, :stop],
                        bias=None if bias is None else bias[:, :, start:stop, :stop], window=window))
        start = stop
    close(torch.cat(outs, 1), full)


def test_an_eager_cached_step_attends_over_the_written_keys_only():
    """Run eagerly, a cached step hands the backend a view of the written part of the buffers (no copy) and no
    mask for the unwritten tail; a mask over the whole cache is cut to the written keys, one of another width is
    refused naming it."""
    torch.manual_seed(5)
    mha = MultiHeadAttention(8, 2).double().eval()
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    cache = KVCache(1, 10, 2, 4, dtype=torch.float64)
    mha(x[:, :3], cache=cache, is_causal=True)
    seen = []
    real = attention_module.checked

    def spy(q, k, v, **kw):
        seen.append((k, v, kw))
        return real(q, k, v, **kw)

    keep = torch.ones(1, 1, 1, 10, dtype=torch.bool)
    keep[..., 1] = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_module, "checked", spy)
        out = mha(x[:, 3:], cache=cache, is_causal=True, mask=keep)
    (k, v, kw), = seen
    assert k.shape[-2] == v.shape[-2] == 4 and k.data_ptr() == cache.k.data_ptr()
    assert kw["is_causal"] and kw["mask"].shape[-1] == 4
    full = mha(x, is_causal=True, mask=keep[..., :4].expand(1, 1, 4, 4))
    close(out, full[:, 3:])
    with pytest.raises(ValueError, match=r"mask must cover the 5 cached keys .* got shape \(1, 1, 1, 7\)"):
        mha(x[:, :1], cache=cache, mask=torch.ones(1, 1, 1, 7, dtype=torch.bool))
    assert cache.seq_len == 4  # the refused call wrote nothing


#: What a cached step may get wrong: its arguments, and the error it raises.
MISTAKES = {
    "mask of another query length": ({"mask": torch.ones(3, 4, dtype=torch.bool)}, ValueError),
    "float mask": ({"mask": torch.ones(1, 4, dtype=torch.float64)}, TypeError),
    "bias of another query length": ({"bias": torch.zeros(2, 2, 3, 4, dtype=torch.float64)}, ValueError),
    "misspelt backend": ({"backend": "bnad"}, ValueError),
    "negative window": ({"window": (-1, 0)}, ValueError),
    "score_mod of the wrong shape": ({"score_mod": lambda s, b, h, q, kv: s.sum()}, ValueError),
    "a backend that cannot serve it": ({"backend": "band", "need_weights": True}, ValueError),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_refused_cached_step_leaves_the_cache_as_it_was(mistake):
    """Every check of the call runs before the new token is written: a caller that catches the error and
    retries stores the token once, and decodes as if the mistake had never been made."""
    torch.manual_seed(6)
    mha = MultiHeadAttention(8, 2).double().eval()
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    cache = KVCache(1, 6, 2, 4, dtype=torch.float64)
    mha(x[:, :3], cache=cache, is_causal=True)
    before = (cache.k.clone(), cache.v.clone(), cache.seq_len, int(cache.cache_pos), bool(cache.finite))
    kw, error = MISTAKES[mistake]
    with pytest.raises(error):
        mha(x[:, 3:], cache=cache, is_causal=True, **kw)
    after = (cache.k, cache.v, cache.seq_len, int(cache.cache_pos), bool(cache.finite))
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]) and after[2:] == before[2:]
    close(mha(x[:, 3:], cache=cache, is_causal=True), mha(x, is_causal=True)[:, 3:])


REFERENCE_TENSORS = "the reference backend (scores, exponentials, weights)"
#: Cached steps (one query over 4 cached keys, float64, 2 heads) that a dense backend refuses for memory: the
#: arguments of the whole forward, given the bias of its 4 queries (a step takes its row), the backend's words, and
#: the bytes the step forms (the limit that refuses it is one byte less).
TOO_LARGE = {
    # "auto": only the reference backend returns weights; it forms 3 float64 [1, 2, 1, 4] tensors
    "weights": (lambda bias: {"need_weights": True}, REFERENCE_TENSORS, 3 * 2 * 4 * 8),
    "the reference backend by name": (lambda bias: {"backend": "reference"}, REFERENCE_TENSORS, 3 * 2 * 4 * 8),
    # "auto": the decode kernel takes no bias (nor float64), so SDPA serves, merging the bias into a float64
    # attn_mask [1, 2, 1, 4] and its copy
    "a bias": (lambda bias: {"bias": bias}, "the SDPA backend's combined attn_mask", 2 * 2 * 4 * 8),
}


@pytest.mark.parametrize("case", list(TOO_LARGE))
def test_a_cached_step_refused_for_memory_leaves_the_cache_as_it_was(monkeypatch, case):
    """A dense backend's memory refusal is one of the call's checks, raised before the new token is written: the
    refused step leaves the cache exactly as it was, and a retry that fits continues it as a cache that never
    saw the refused step does."""
    torch.manual_seed(8)
    monkeypatch.delenv(MAX_DENSE_BYTES_ENV, raising=False)
    mha = MultiHeadAttention(8, 2).double().eval()
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    make_kw, who, nbytes = TOO_LARGE[case]
    full_kw = make_kw(torch.randn(1, 2, 4, 4, dtype=torch.float64))
    step_kw = {name: val[:, :, 3:] if name == "bias" else val for name, val in full_kw.items()}
    cache, untouched = (KVCache(1, 6, 2, 4, dtype=torch.float64) for _ in range(2))
    for c in (cache, untouched):
        mha(x[:, :3], cache=c, is_causal=True)
    before = (cache.k.clone(), cache.v.clone(), cache.seq_len, int(cache.cache_pos), bool(cache.finite))
    monkeypatch.setenv(MAX_DENSE_BYTES_ENV, str(nbytes - 1))
    with pytest.raises(ValueError, match=rf"^{re.escape(who)} would materialise .* = {nbytes} bytes, more than the "
                                         rf"limit of {nbytes - 1} bytes \(set by {MAX_DENSE_BYTES_ENV}\)\. "
                                         r"backend='blockwise' computes tile by tile"):
        mha(x[:, 3:], cache=cache, is_causal=True, **step_kw)
    after = (cache.k, cache.v, cache.seq_len, int(cache.cache_pos), bool(cache.finite))
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]) and after[2:] == before[2:]
    monkeypatch.setenv(MAX_DENSE_BYTES_ENV, str(nbytes))  # exactly what the step forms: it fits
    got = mha(x[:, 3:], cache=cache, is_causal=True, **step_kw)
    want = mha(x[:, 3:], cache=untouched, is_causal=True, **step_kw)
    got, want = ((r if isinstance(r, tuple) else (r,)) for r in (got, want))
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(cache.k, untouched.k) and torch.equal(cache.v, untouched.v)
    assert cache.seq_len == untouched.seq_len == int(cache.cache_pos) == 4 and bool(cache.finite)
    monkeypatch.delenv(MAX_DENSE_BYTES_ENV)
    full_out, full_weights = mha(x, is_causal=True, **(full_kw | {"need_weights": True}))
    close(got[0], full_out[:, 3:])
    if len(got) == 2:
        close(got[1], full_weights[:, :, 3:])


def test_auto_serves_cached_steps_on_kernels_that_form_no_dense_tensor_under_any_limit(monkeypatch):
    """Only the backend that serves a call checks its memory: under a limit no dense tensor fits, "auto" still
    serves a windowed cached decode with the blockwise kernels it picks today (SDPA takes no window), and the
    reference backend, which would not fit, is never asked to."""
    torch.manual_seed(9)
    monkeypatch.delenv(MAX_DENSE_BYTES_ENV, raising=False)
    mha = MultiHeadAttention(8, 2).double().eval()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    full = mha(x, is_causal=True, window=(2, 0))
    monkeypatch.setenv(MAX_DENSE_BYTES_ENV, "0")
    cache = KVCache(1, 8, 2, 4, dtype=torch.float64)
    with attnkit.backends.served() as names:
        inc = _decode_in_chunks(mha, x, [3, 1, 2], cache, is_causal=True, window=(2, 0))
    assert len(names) == 3 and not {"sdpa", "reference"} & set(names), names
    close(inc, full)


def test_cache_rejects_cross_attention_and_wrong_key_mask():
    mha = MultiHeadAttention(8, 2)
    cache = KVCache(1, 4, 2, 4)
    x = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="self-attention"):
        mha(x, x, cache=cache)
    with pytest.raises(ValueError, match=r"key_mask must be a bool \[B, Lk\] = \(1, 2\)"):
        mha(x, cache=cache, key_mask=torch.ones(1, 3, dtype=torch.bool))


@given(
    cuts=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    kv_heads=st.sampled_from([1, 2]),
    kind=st.sampled_from(sorted(POSITIONS)),
)
def test_any_chunking_of_cached_decoding_equals_full_forward(cuts, kv_heads, kind):
    torch.manual_seed(sum(cuts))
    e, h = 8, 2
    mha = MultiHeadAttention(e, h, num_kv_heads=kv_heads, **POSITIONS[kind](h, e // h)).double().eval()
    x = torch.randn(1, sum(cuts), e, dtype=torch.float64)
    cache = KVCache(1, sum(cuts), kv_heads, e // h, dtype=torch.float64)
    close(_decode_in_chunks(mha, x, cuts, cache, is_causal=True), mha(x, is_causal=True))


def test_need_weights_with_cache_cover_all_cached_keys():
    torch.manual_seed(2)
    mha = MultiHeadAttention(8, 2, position_bias=ALiBi(2)).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    _, full_w = mha(x, is_causal=True, need_weights=True)
    cache = KVCache(1, 5, 2, 4, dtype=torch.float64)
    mha(x[:, :4], cache=cache, is_causal=True)
    _, w = mha(x[:, 4:], cache=cache, is_causal=True, need_weights=True)
    assert w.shape == (1, 2, 1, 5)
    close(w, full_w[:, :, 4:])


def test_reorder_gives_each_row_the_cached_keys_of_the_row_it_continues():
    cache = KVCache(3, 6, num_kv_heads=2, head_dim=4, v_head_dim=5)
    k, v = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 5)
    cache.update(k, v)
    index = torch.tensor([2, 2, 0])
    cache.reorder(index)
    assert torch.equal(cache.k[:, :, :4], k[index]) and torch.equal(cache.v[:, :, :4], v[index])
    assert cache.seq_len == 4
    k_all, _, length, _ = cache.update(torch.ones(3, 2, 1, 4), torch.ones(3, 2, 1, 5))  # appending still works
    assert torch.equal(k_all[:, :, :4], k[index]) and torch.equal(k_all[:, :, 4], torch.ones(3, 2, 4))
    assert int(length) == 5


@pytest.mark.parametrize("index", [torch.tensor([0, 1]), torch.tensor([0, 1, 3]), torch.tensor([0.0, 1.0, 2.0]),
                                   [0, 1, 2], torch.tensor([-1, 0, 1])])
def test_reorder_refuses_a_bad_index_naming_it(index):
    cache = KVCache(3, 4, num_kv_heads=1, head_dim=2)
    with pytest.raises(ValueError, match="index"):
        cache.reorder(index)


def test_crop_takes_back_tokens_and_decoding_goes_on_as_if_they_were_never_written():
    torch.manual_seed(6)
    mha = MultiHeadAttention(8, 2).double().eval()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    cache = KVCache(1, 8, 2, 4, dtype=torch.float64)
    mha(x[:, :4], cache=cache, is_causal=True)
    rejected = x[:, 4:].clone()
    rejected[0, 0, 0] = float("nan")  # a draft token with a NaN: gone with the crop, the flag read again
    mha(rejected, cache=cache, is_causal=True)
    assert not bool(cache.finite)
    cache.crop(4)
    assert cache.seq_len == 4 and int(cache.cache_pos) == 4 and bool(cache.finite)
    assert not cache.k[:, :, 4:].any() and not cache.v[:, :, 4:].any()  # freed: zeroed
    out = mha(x[:, 4:], cache=cache, is_causal=True)
    close(out, mha(x, is_causal=True)[:, 4:])
    cache.crop(6)  # at seq_len: nothing to do
    assert cache.seq_len == 6
    with pytest.raises(ValueError, match=r"length must be an int in \[0, 6\] \(seq_len\), got 7"):
        cache.crop(7)
    with pytest.raises(ValueError, match="got True"):
        cache.crop(True)


def test_reset_zeroes_the_buffers():
    cache = KVCache(1, 5, num_kv_heads=2, head_dim=3)
    cache.update(torch.randn(1, 2, 4, 3), torch.full((1, 2, 4, 3), float("nan")))
    cache.reset()
    assert torch.equal(cache.k, torch.zeros_like(cache.k)) and torch.equal(cache.v, torch.zeros_like(cache.v))


@pytest.mark.parametrize("backend", ["auto", *eager_backends()])
def test_a_nan_token_before_reset_does_not_reach_a_shorter_clean_sequence(backend):
    torch.manual_seed(3)
    mha = MultiHeadAttention(8, 2, backend=backend).double().eval()
    cache = KVCache(1, 8, 2, 4, dtype=torch.float64)
    poisoned = torch.randn(1, 6, 8, dtype=torch.float64)
    poisoned[0, 4] = float("nan")
    with torch.no_grad():
        assert mha(poisoned, cache=cache, is_causal=True)[0, 4:].isnan().all()  # the NaN token, and after it
        cache.reset()
        x = torch.randn(1, 3, 8, dtype=torch.float64)
        got = torch.cat([mha(x[:, :2], cache=cache, is_causal=True), mha(x[:, 2:], cache=cache, is_causal=True)], 1)
        fresh = KVCache(1, 8, 2, 4, dtype=torch.float64)
        want = torch.cat([mha(x[:, :2], cache=fresh, is_causal=True), mha(x[:, 2:], cache=fresh, is_causal=True)], 1)
    assert torch.equal(got, want)


def test_the_finiteness_of_what_was_written_is_kept_and_a_write_by_hand_is_seen():
    torch.manual_seed(4)
    mha = MultiHeadAttention(8, 2).double().eval()
    cache = KVCache(1, 8, 2, 4, dtype=torch.float64)
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        mha(x[:, :2], cache=cache, is_causal=True)
        assert bool(cache.finite)
        cache.v[0, 0, 1, 0] = float("nan")  # not through update(): the cache cannot vouch for it
        assert mha(x[:, 2:3], cache=cache, is_causal=True).isnan().all()
        assert not bool(cache.finite)
        cache.reset()
        assert bool(cache.finite)
        assert torch.isfinite(mha(x[:, :3], cache=cache, is_causal=True)).all()


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("backend", ["auto", *eager_backends()])
def test_a_nan_in_the_newest_token_poisons_exactly_the_heads_that_see_it(backend, where):
    """Decode steps over a cache whose buffers it vouches for (the check reads the query and the cache's flag):
    a NaN in the newest token's key or value makes the query heads of its key/value head NaN, forward and
    ``dq``, for as long as the window (the last 2 positions) sees it, and every other head the clean cache's
    bit for bit; a NaN in the query makes its own head NaN, at its own step only."""
    g = torch.Generator().manual_seed(9)
    n, steps = 5, 4  # token n is poisoned; the queries at n, n + 1 see it, those at n + 2, n + 3 do not
    qs = torch.randn(1, 4, n + steps, 8, generator=g, dtype=torch.float64)  # query heads 0, 1 read kv head 0
    ks, vs = (torch.randn(1, 2, n + steps, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dirty = {"q": qs.clone(), "k": ks.clone(), "v": vs.clone()}
    dirty[where][0, 3 if where == "q" else 0, n, 2] = float("nan")
    caches = [KVCache(1, 16, 2, 8, dtype=torch.float64) for _ in range(2)]
    for cache in caches:
        cache.update(ks[:, :, :n], vs[:, :, :n])
    for pos in range(n, n + steps):
        got = []
        for cache, t in zip(caches, ({"q": qs, "k": ks, "v": vs}, dirty), strict=True):
            cached = cache.update(t["k"][:, :, pos:pos + 1], t["v"][:, :, pos:pos + 1])
            q = t["q"][:, :, pos:pos + 1].clone().requires_grad_()
            out = attnkit.attention(q, cached.k, cached.v, mask=visible(cached, 1, causal=True, window=(1, 0)),
                                    backend=backend)
            got.append((out.detach(), *torch.autograd.grad(out, q, torch.ones_like(out))))
        heads = ([3] if pos == n else []) if where == "q" else ([0, 1] if pos - n <= 1 else [])
        others = [h for h in range(4) if h not in heads]
        for want, have in zip(*got, strict=True):  # out, then dq: [1, 4, 1, 8]
            assert have[0, heads].isnan().all(), (pos, heads)
            assert torch.equal(have[0, others], want[0, others]), (pos, others)
