"""Transformer blocks: parity with torch.nn with weights copied, masks converted, cached decoding."""

import pytest
import torch
from torch import nn

from attnkit.cache import KVCache
from attnkit.masks import from_key_padding_mask
from attnkit.modules import (
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    from_torch_attn_mask,
)
from attnkit.positional import ALiBi, RotaryEmbedding, T5RelativeBias
from tests.support.tolerances import PARITY, close

E, H, FF = 16, 4, 24


def _randomise_norms(module):
    # Fresh LayerNorms are the identity; random affine parameters make a wrong copy visible.
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_()
                if m.bias is not None:
                    m.bias.normal_()


def _padding(b, n, lengths):
    pad = torch.zeros(b, n, dtype=torch.bool)  # torch: True = ignore
    for i, length in enumerate(lengths):
        pad[i, length:] = True
    return pad


def _ours_key_mask(torch_pad):
    return from_key_padding_mask(torch_pad)[:, 0, 0, :]


# Parity is checked in float64, where both sides round at ~1e-16 and the float64 row holds on any CPU;
# one float32 run per layer kind keeps the users' dtype covered, at the measured row.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch_with_masks(norm_first, activation, dtype):
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, activation=activation, batch_first=True,
                                     norm_first=norm_first, dtype=dtype)
    _randomise_norms(ref)
    ours = TransformerEncoderLayer.from_torch(ref)
    x = torch.randn(3, 7, E, dtype=dtype)
    pad = _padding(3, 7, [7, 5, 2])
    attn_mask = torch.rand(7, 7) < 0.3
    attn_mask.fill_diagonal_(False)  # no row fully masked (torch would give NaN there)
    close(ours(x), ref(x), **PARITY[dtype])
    mask, _ = from_torch_attn_mask(attn_mask)
    close(ours(x, mask=mask, key_mask=_ours_key_mask(pad)),
          ref(x, src_mask=attn_mask, src_key_padding_mask=pad), **PARITY[dtype])
    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=dtype)  # float, -inf above the diagonal
    close(ours(x, is_causal=True), ref(x, src_mask=causal, is_causal=True), **PARITY[dtype])
    _, bias = from_torch_attn_mask(causal)
    close(ours(x, bias=bias), ref(x, src_mask=causal), **PARITY[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch_with_masks(norm_first, dtype):
    torch.manual_seed(1)
    ref = nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first, dtype=dtype)
    _randomise_norms(ref)
    ours = TransformerDecoderLayer.from_torch(ref)
    tgt, mem = torch.randn(2, 6, E, dtype=dtype), torch.randn(2, 9, E, dtype=dtype)
    tgt_pad, mem_pad = _padding(2, 6, [6, 4]), _padding(2, 9, [9, 3])
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # torch: True = not allowed
    want = ref(tgt, mem, tgt_mask=causal, tgt_is_causal=True, tgt_key_padding_mask=tgt_pad,
               memory_key_padding_mask=mem_pad)
    got = ours(tgt, mem, key_mask=_ours_key_mask(tgt_pad), memory_key_mask=_ours_key_mask(mem_pad))
    close(got, want, **PARITY[dtype])
    mem_mask = torch.rand(2 * H, 6, 9) < 0.4
    mem_mask[..., 0] = False
    mask, _ = from_torch_attn_mask(mem_mask, num_heads=H)
    close(ours(tgt, mem, memory_mask=mask, is_causal=False),
          ref(tgt, mem, memory_mask=mem_mask), **PARITY[dtype])


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # torch's own notice for norm_first
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_matches_torch(norm_first):
    torch.manual_seed(2)
    ref = nn.Transformer(E, H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=FF, dropout=0.0,
                         batch_first=True, norm_first=norm_first, dtype=torch.float64)
    ref.encoder.enable_nested_tensor = False
    _randomise_norms(ref)
    ours = Transformer.from_torch(ref)
    src, tgt = torch.randn(2, 8, E, dtype=torch.float64), torch.randn(2, 5, E, dtype=torch.float64)
    src_pad = _padding(2, 8, [8, 6])
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    # Gradients on, so torch takes its plain path (its inference fast path drops padded rows).
    want = ref(src, tgt, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src_pad,
               memory_key_padding_mask=src_pad)
    km = _ours_key_mask(src_pad)
    close(ours(src, tgt, src_key_mask=km, memory_key_mask=km), want)


def test_stacks_from_torch_keep_layers_and_norm():
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, dtype=torch.float64)
    ref = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(E, dtype=torch.float64), enable_nested_tensor=False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))  # torch clones identical layers; make them differ
    ours = TransformerEncoder.from_torch(ref)
    assert len(ours.layers) == 3 and isinstance(ours.norm, nn.LayerNorm)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    close(ours(x), ref(x))
    dref = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True,
                                                            dtype=torch.float64), 2)
    dours = TransformerDecoder.from_torch(dref)
    mem = torch.randn(2, 4, E, dtype=torch.float64)
    close(dours(x, mem, is_causal=False), dref(x, mem))


def test_post_norm_layer_is_seed_004_residual_layernorm():
    # Seed 004: out = LayerNorm(Dropout(fc(attention)) + x): the post-norm attention sublayer.
    torch.manual_seed(4)
    layer = TransformerEncoderLayer(E, H, ffn_dim=FF, dropout=0.0).double().eval()
    x = torch.randn(2, 5, E, dtype=torch.float64)
    h = layer.norm1(x + layer.self_attn(x))
    want = layer.norm2(h + layer.ff.linear2(torch.relu(layer.ff.linear1(h))))
    close(layer(x), want)


def test_dropout_is_active_in_training_only():
    torch.manual_seed(5)
    layer = TransformerEncoderLayer(E, H, ffn_dim=FF, dropout=0.5)
    x = torch.randn(2, 5, E)
    layer.train()
    a, b = layer(x), layer(x)
    assert not torch.allclose(a, b)
    layer.eval()
    close(layer(x), layer(x), atol=0.0, rtol=0.0)


POSITIONAL = {
    "none": dict,
    "rope": lambda: {"rotary": RotaryEmbedding(E // H)},
    "alibi": lambda: {"position_bias": ALiBi(H)},
    "t5": lambda: {"position_bias": T5RelativeBias(H, num_buckets=8, max_distance=16, bidirectional=False)},
}


@pytest.mark.parametrize("kind", sorted(POSITIONAL))
@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_decoder_equals_full_forward(kind, norm_first):
    torch.manual_seed(6)
    layers = [TransformerDecoderLayer(E, H, ffn_dim=FF, dropout=0.0, norm_first=norm_first, **POSITIONAL[kind]())
              for _ in range(2)]
    dec = TransformerDecoder(layers, norm=nn.LayerNorm(E)).double().eval()
    _randomise_norms(dec)
    tgt, mem = torch.randn(2, 8, E, dtype=torch.float64), torch.randn(2, 5, E, dtype=torch.float64)
    mem_km = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    full = dec(tgt, mem, memory_key_mask=mem_km)
    caches = dec.make_caches(2, 8)
    assert caches[0].k.dtype == torch.float64
    steps, start = [3, 1, 2, 1, 1], 0  # a prompt, single tokens and a chunk (Lq != Lk)
    outs = []
    for n in steps:
        outs.append(dec(tgt[:, start:start + n], mem, memory_key_mask=mem_km, caches=caches))
        start += n
    close(torch.cat(outs, 1), full)
    assert all(c.seq_len == 8 for c in caches)


def test_future_tokens_do_not_change_earlier_decoder_outputs():
    torch.manual_seed(7)
    dec = TransformerDecoderLayer(E, H, ffn_dim=FF, dropout=0.0, rotary=RotaryEmbedding(E // H)).double()
    tgt, mem = torch.randn(1, 6, E, dtype=torch.float64), torch.randn(1, 4, E, dtype=torch.float64)
    out = dec(tgt, mem)
    tgt2 = tgt.clone()
    tgt2[:, 4:] = torch.randn(1, 2, E, dtype=torch.float64)
    close(dec(tgt2, mem)[:, :4], out[:, :4])


def test_transformer_encode_decode_with_caches_matches_forward():
    torch.manual_seed(8)
    model = Transformer(E, H, num_encoder_layers=1, num_decoder_layers=2, ffn_dim=FF, dropout=0.0).double()
    src, tgt = torch.randn(2, 6, E, dtype=torch.float64), torch.randn(2, 4, E, dtype=torch.float64)
    full = model(src, tgt)
    memory = model.encode(src)
    caches = model.decoder.make_caches(2, 4)
    steps = [model.decode(tgt[:, t:t + 1], memory, caches=caches) for t in range(4)]
    close(torch.cat(steps, 1), full)


def test_errors_name_the_problem():
    dec = TransformerDecoder([TransformerDecoderLayer(E, H, ffn_dim=FF) for _ in range(2)])
    with pytest.raises(ValueError, match=r"one KVCache per layer \(2\), got 1"):
        dec(torch.randn(1, 1, E), torch.randn(1, 2, E), caches=[KVCache(1, 4, H, E // H)])
    with pytest.raises(ValueError, match="activation must be one of"):
        TransformerEncoderLayer(E, H, activation="swish")
    with pytest.raises(TypeError, match="from_torch expects torch.nn.TransformerEncoderLayer"):
        TransformerEncoderLayer.from_torch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs num_heads"):
        from_torch_attn_mask(torch.zeros(6, 3, 3, dtype=torch.bool))


def test_layers_without_bias_other_eps_and_module_activation_match_torch():
    torch.manual_seed(9)
    kw = {"dropout": 0.0, "batch_first": True, "bias": False, "layer_norm_eps": 1e-6,
          "activation": nn.GELU(approximate="tanh"), "dtype": torch.float64}
    enc, dec = nn.TransformerEncoderLayer(E, H, FF, **kw), nn.TransformerDecoderLayer(E, H, FF, norm_first=True, **kw)
    _randomise_norms(enc)
    _randomise_norms(dec)
    ours_enc, ours_dec = TransformerEncoderLayer.from_torch(enc), TransformerDecoderLayer.from_torch(dec)
    assert ours_enc.ff.linear1.bias is None and ours_enc.norm1.bias is None and ours_enc.norm1.eps == 1e-6
    x, mem = torch.randn(2, 5, E, dtype=torch.float64), torch.randn(2, 3, E, dtype=torch.float64)
    close(ours_enc(x), enc(x))
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    close(ours_dec(x, mem), dec(x, mem, tgt_mask=causal))
