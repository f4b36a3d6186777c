"""Positional encodings: each against an independent formula and, where it exists, the real library."""

import cmath
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit.modules import MultiHeadAttention
from attnkit.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    RelativeKeyEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    T5RelativeBias,
    apply_rotary,
    sinusoidal_table,
    t5_relative_position_bucket,
)
from attnkit.scores import alibi_slopes
from tests.support import oracle
from tests.support.tolerances import close

# ------------------------------------------------------------------------------ sinusoidal


@pytest.mark.parametrize("dim", [1, 6, 7, 16])
def test_sinusoidal_is_seed_002_formula(dim):
    start, n = 3, 11
    pe = sinusoidal_table(n, dim, start=start, dtype=torch.float64)
    want = torch.empty(n, dim, dtype=torch.float64)
    for row in range(n):
        pos = start + row
        for col in range(dim):
            i = col // 2  # PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...)
            angle = pos / 10000 ** (2 * i / dim)
            want[row, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    close(pe, want)


def test_sinusoidal_module_adds_table_at_start_and_keeps_dtype():
    m = SinusoidalPositionalEncoding(8)
    x = torch.randn(2, 5, 8)
    close(m(x, start=4), x + sinusoidal_table(9, 8)[4:])
    assert m(x.double()).dtype == torch.float64
    with pytest.raises(ValueError, match=r"x must be \[B, L, 8\]"):
        m(torch.randn(2, 5, 6))


def test_learned_absolute_adds_rows_and_checks_range():
    m = LearnedPositionalEmbedding(6, 4)
    x = torch.randn(3, 2, 4)
    close(m(x, start=3), x + m.embedding.weight[3:5])
    with pytest.raises(ValueError, match="positions 5..6 exceed max_len 6"):
        m(x, start=5)
    assert m(x).requires_grad  # the table trains


# ------------------------------------------------------------------------------ rotary


def _complex_rope(x, positions, pairs, base=10000.0):
    """Independent RoPE: view feature pairs as complex numbers and multiply by e^{i p theta_j}."""
    out = x.clone().to(torch.float64)
    d_rot = 2 * len(pairs)
    for row, p in enumerate(positions):
        for j, (a, b) in enumerate(pairs):
            z = complex(x[..., row, a].item(), x[..., row, b].item()) * cmath.exp(1j * p * base ** (-2 * j / d_rot))
            out[..., row, a], out[..., row, b] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_rope_equals_complex_multiplication(interleaved, rotary_dim):
    torch.manual_seed(0)
    d, n, start = 8, 5, 7
    r = d if rotary_dim is None else rotary_dim
    pairs = [(2 * j, 2 * j + 1) for j in range(r // 2)] if interleaved else [(j, j + r // 2) for j in range(r // 2)]
    x = torch.randn(n, d, dtype=torch.float64)
    rope = RotaryEmbedding(d, interleaved=interleaved, rotary_dim=rotary_dim)
    close(rope(x, start), _complex_rope(x, range(start, start + n), pairs))


def test_rope_half_layout_matches_hf_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    torch.manual_seed(0)
    b, h, n, d = 2, 3, 6, 16
    cfg = LlamaConfig(hidden_size=h * d, num_attention_heads=h, head_dim=d, max_position_embeddings=64)
    hf = LlamaRotaryEmbedding(cfg)
    q, k = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    pos = torch.arange(5, 5 + n)[None].expand(b, n)
    cos, sin = hf(q, pos)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    rope = RotaryEmbedding(d)
    # float32 on purpose (transformers computes the angles in float32 whatever the input dtype); an
    # elementwise rotation, so a few ulps apart on any CPU: the float32 row.
    close(rope(q, 5), q_hf)
    close(rope(k, 5), k_hf)


@given(m=st.integers(0, 50), n=st.integers(0, 50), shift=st.integers(0, 50), interleaved=st.booleans())
def test_rope_scores_depend_only_on_relative_position(m, n, shift, interleaved):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 8, generator=g, dtype=torch.float64), torch.randn(1, 8, generator=g, dtype=torch.float64)
    rope = RotaryEmbedding(8, interleaved=interleaved)
    s1 = rope(q, m) @ rope(k, n).T
    s2 = rope(q, m + shift) @ rope(k, n + shift).T
    close(s1, s2)


def test_rope_gradcheck():
    rope = RotaryEmbedding(6, interleaved=True)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    cos, sin = rope.cos_sin(3, 2, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin, interleaved=True), (x,))
    assert torch.autograd.gradcheck(lambda t: rope(t, 1), (x,))


def test_rope_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"rotary_dim \(5\) must be even and <= head_dim \(8\)"):
        RotaryEmbedding(8, rotary_dim=5)
    with pytest.raises(ValueError, match=r"x must be \[..., L, 8\]"):
        RotaryEmbedding(8)(torch.randn(2, 3, 4))


# ------------------------------------------------------------------------------ ALiBi


def test_alibi_slopes_follow_the_paper_for_any_head_count():
    # The paper: for 2^k heads, a geometric sequence from 2^(-8/n) with that ratio; otherwise the
    # slopes of the closest lower power of two, then every other slope of twice that count.
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    assert alibi_slopes(6).tolist() == [2.0 ** -e for e in (2, 4, 6, 8, 1, 3)]
    close(alibi_slopes(12, dtype=torch.float64),
          torch.tensor([2.0 ** -e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)], dtype=torch.float64))
    close(alibi_slopes(3, dtype=torch.float64), torch.tensor([2 ** -4, 2 ** -8, 2 ** -2], dtype=torch.float64))


@pytest.mark.parametrize("heads", [3, 4])
def test_alibi_in_mha_matches_oracle_with_explicit_bias(heads):
    torch.manual_seed(0)
    e, n = 12, 7
    mha = MultiHeadAttention(e, heads, position_bias=ALiBi(heads)).double()
    x = torch.randn(2, n, e, dtype=torch.float64)
    q, k, v = mha.project_qkv(x, x, x)
    slopes = alibi_slopes(heads, dtype=torch.float64)
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    bias = -slopes.view(-1, 1, 1) * (j - i).abs()  # the paper's -m (i - j) below the diagonal
    want, _ = oracle.attention(q, k, v, bias=bias, allowed=oracle.allowed_grid(2, heads, n, n, is_causal=True))
    got = mha(x, is_causal=True)
    close(got, mha.out_proj(want.transpose(1, 2).reshape(2, n, -1)))
    close(ALiBi(heads).bias(n, n).double(), bias)


# ------------------------------------------------------------------------------ T5 buckets


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 20), (16, 16), (6, 50), (5, 9), (4, 8)])
def test_t5_buckets_equal_hugging_face(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-400, 401)
    want = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                                 max_distance=max_distance)
    got = t5_relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                      max_distance=max_distance)
    assert torch.equal(got, want)
    assert int(got.min()) >= 0 and int(got.max()) < num_buckets


def test_t5_buckets_reject_degenerate_sizes():
    with pytest.raises(ValueError, match="num_buckets >= 4"):
        t5_relative_position_bucket(torch.arange(3), num_buckets=2, max_distance=8)
    with pytest.raises(ValueError, match="max_distance > 8"):
        T5RelativeBias(2, num_buckets=32, max_distance=8)


def _hf_t5_attention(bidirectional, seed=0):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    torch.manual_seed(seed)
    cfg = T5Config(d_model=16, d_kv=4, num_heads=3, relative_attention_num_buckets=8,
                   relative_attention_max_distance=12, dropout_rate=0.0, is_decoder=not bidirectional)
    hf = T5Attention(cfg, has_relative_attention_bias=True, is_causal=not bidirectional).eval()
    ours = MultiHeadAttention(16, 3, head_dim=4, bias=False, scale=1.0,
                              position_bias=T5RelativeBias(3, num_buckets=8, max_distance=12,
                                                           bidirectional=bidirectional))
    with torch.no_grad():
        for mine, theirs in ((ours.q_proj, hf.q), (ours.k_proj, hf.k), (ours.v_proj, hf.v), (ours.out_proj, hf.o)):
            mine.weight.copy_(theirs.weight)
        ours.position_bias.relative_attention_bias.weight.copy_(hf.relative_attention_bias.weight)
    return hf.double(), ours.double().eval()  # float64: parity holds at the float64 row on any CPU


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bias_equals_hf_compute_bias(bidirectional):
    hf, ours = _hf_t5_attention(bidirectional)
    for q_len, kv_len, past in ((20, 20, 0), (1, 17, 16), (3, 9, 6)):
        want = hf.compute_bias(q_len, kv_len, past_seen_tokens=past)[0]
        close(ours.position_bias.bias(q_len, kv_len, offset=past), want)


def test_t5_encoder_attention_equals_hf_t5attention():
    hf, ours = _hf_t5_attention(True)
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    with torch.no_grad():
        close(ours(x), hf(x)[0])


# ------------------------------------------------------------------------------ Shaw / relative_key


def _bert_relative_key_reference(q, k, v, table, max_pos):
    """The old HF BERT ``relative_key`` eager path, written out in float64 (no clipping needed)."""
    lq, lk = q.shape[-2], k.shape[-2]
    dist = torch.arange(lq).view(-1, 1) - torch.arange(lk).view(1, -1)
    r = table[dist + max_pos - 1]  # (Lq, Lk, D)
    s = q @ k.transpose(-1, -2) + torch.einsum("bhld,lrd->bhlr", q, r)
    return torch.softmax(s / math.sqrt(q.shape[-1]), -1) @ v


def test_relative_key_equals_bert_formula():
    torch.manual_seed(0)
    e, h, n, max_pos = 16, 2, 6, 6  # every distance fits: BERT's table, no clipping
    rel = RelativeKeyEmbedding(max_pos - 1, e // h)
    torch.nn.init.normal_(rel.distance_embedding.weight)
    mha = MultiHeadAttention(e, h, position_bias=rel).double()
    x = torch.randn(2, n, e, dtype=torch.float64)
    q, k, v = mha.project_qkv(x, x, x)
    want = _bert_relative_key_reference(q, k, v, rel.distance_embedding.weight.double(), max_pos)
    close(mha(x), mha.out_proj(want.transpose(1, 2).reshape(2, n, e)))


def test_relative_key_equals_hf_wav2vec2bert_relative_key():
    # transformers 5.x dropped BERT's relative_key; Wav2Vec2-BERT keeps the same Shaw term (with
    # clipping), indexing its table by key - query, i.e. our table upside down.
    from transformers import Wav2Vec2BertConfig
    from transformers.models.wav2vec2_bert.modeling_wav2vec2_bert import Wav2Vec2BertSelfAttention

    torch.manual_seed(0)
    e, h, m = 16, 4, 3
    cfg = Wav2Vec2BertConfig(hidden_size=e, num_attention_heads=h, position_embeddings_type="relative_key",
                             left_max_position_embeddings=m, right_max_position_embeddings=m,
                             attention_dropout=0.0)
    hf = Wav2Vec2BertSelfAttention(cfg).double().eval()  # float64: parity at the float64 row on any CPU
    ours = MultiHeadAttention(e, h, position_bias=RelativeKeyEmbedding(m, e // h)).double().eval()
    with torch.no_grad():
        for mine, theirs in ((ours.q_proj, hf.linear_q), (ours.k_proj, hf.linear_k), (ours.v_proj, hf.linear_v),
                             (ours.out_proj, hf.linear_out)):
            mine.weight.copy_(theirs.weight)
            mine.bias.copy_(theirs.bias)
        ours.position_bias.distance_embedding.weight.copy_(hf.distance_embedding.weight.flip(0))
        x = torch.randn(2, 9, e, dtype=torch.float64)  # longer than the clipping distance
        close(ours(x), hf(x)[0])


def test_position_bias_gradients_reach_the_tables():
    rel = RelativeKeyEmbedding(2, 4)
    t5 = T5RelativeBias(2, num_buckets=4, max_distance=8)
    for pb in (rel, t5):
        mha = MultiHeadAttention(8, 2, position_bias=pb)
        mha(torch.randn(1, 5, 8)).sum().backward()
        grads = [p.grad for p in pb.parameters()]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_position_bias_type_is_checked():
    with pytest.raises(TypeError, match="position_bias must have a score_mod"):
        MultiHeadAttention(8, 2, position_bias=torch.zeros(3))
    with pytest.raises(TypeError, match="rotary must be callable"):
        MultiHeadAttention(8, 2, rotary=3)


def test_absolute_encodings_fed_in_chunks_equal_one_pass():
    x = torch.randn(2, 7, 6)
    for m in (SinusoidalPositionalEncoding(6), LearnedPositionalEmbedding(10, 6)):
        chunks = [m(x[:, :3], 0), m(x[:, 3:4], 3), m(x[:, 4:], 4)]
        close(torch.cat(chunks, 1), m(x))


@pytest.mark.parametrize("make", [
    lambda: RelativeKeyEmbedding(1, 2, dtype=torch.float64),
    lambda: T5RelativeBias(2, num_buckets=4, max_distance=6, dtype=torch.float64),
    lambda: ALiBi(2),
])
def test_attention_with_position_bias_gradcheck(make):
    torch.manual_seed(0)
    mha = MultiHeadAttention(4, 2, position_bias=make()).double()
    x = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: mha(t, is_causal=True), (x,))
    for name, p in mha.position_bias.named_parameters(prefix="position_bias"):
        table = p.detach().clone().requires_grad_()
        assert torch.autograd.gradcheck(
            lambda t, name=name: torch.func.functional_call(mha, {name: t}, (x.detach(),), {"is_causal": True}),
            (table,))
