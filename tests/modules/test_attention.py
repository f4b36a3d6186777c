"""MultiHeadAttention: shapes, variants, and parity with torch.nn.MultiheadAttention (weights copied)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnkit
from attnkit import masks
from tests.support import oracle
from tests.support.tolerances import PARITY, close


def torch_pair(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    theirs = nn.MultiheadAttention(batch_first=True, dtype=dtype, **kw).eval()
    with torch.no_grad():  # torch zeroes its biases at init: randomise them so they are tested
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return theirs, attnkit.MultiHeadAttention.from_torch(theirs).eval()


def parity(a, b):
    """float64: the float64 row, on any CPU; float32: the row measured for two operation orders."""
    close(a, b, **PARITY[a.dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", [
    {"embed_dim": 32, "num_heads": 8},
    {"embed_dim": 24, "num_heads": 3, "bias": False},
    {"embed_dim": 16, "num_heads": 4, "kdim": 10, "vdim": 6},
])
def test_same_outputs_and_weights_as_torch(config, dtype):
    theirs, ours = torch_pair(dtype=dtype, **config)
    x = torch.randn(3, 5, config["embed_dim"], dtype=dtype)
    kv_k = torch.randn(3, 7, config.get("kdim", config["embed_dim"]), dtype=dtype)
    kv_v = torch.randn(3, 7, config.get("vdim", config["embed_dim"]), dtype=dtype)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[1, 4:] = True
    kpm[2, 1:] = True
    a, aw = theirs(x, kv_k, kv_v, key_padding_mask=kpm, average_attn_weights=False)
    b, bw = ours(x, kv_k, kv_v, key_mask=~kpm, need_weights=True)
    assert b.dtype == dtype
    parity(b, a)
    parity(bw, aw)
    # PyTorch's bool attn_mask: True = NOT allowed; ours: True = may attend
    if "kdim" not in config:
        causal_torch = torch.ones(5, 5, dtype=torch.bool).triu(1)
        a, aw = theirs(x, x, x, attn_mask=causal_torch, average_attn_weights=False)
        b, bw = ours(x, mask=~causal_torch, need_weights=True)
        parity(b, a)
        parity(bw, aw)
        b2 = ours(x, is_causal=True)
        parity(b2, a)


def test_every_key_padded_gives_zeros_where_torch_gives_nan():
    theirs, ours = torch_pair(embed_dim=16, num_heads=4)
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    kpm = torch.zeros(2, 4, dtype=torch.bool)
    kpm[1] = True  # sequence 1 is all padding
    a, _ = theirs(x, x, x, key_padding_mask=kpm)
    b = ours(x, key_mask=~kpm)
    parity(b[0], a[0])
    # the documented gap in torch.nn.MultiheadAttention (ANCHORS.md); ours stays finite
    assert torch.isnan(a[1]).all()
    assert torch.isfinite(b[1]).all()
    # attention output is zero, so what remains is the output projection's bias
    close(b[1], ours.out_proj.bias.expand(4, 16))


def test_to_torch_round_trip():
    ours = attnkit.MultiHeadAttention(12, 3, kdim=5, vdim=7, dtype=torch.float64).eval()
    theirs = ours.to_torch().eval()
    assert theirs.out_proj.weight.dtype == torch.float64
    q, k, v = (torch.randn(2, n, e, dtype=torch.float64) for n, e in ((4, 12), (6, 5), (6, 7)))
    parity(ours(q, k, v), theirs(q, k, v)[0])
    shared = attnkit.MultiHeadAttention(8, 2, share_kv=True, dtype=torch.float64).eval()
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    parity(shared(x), shared.to_torch().eval()(x, x, x)[0])
    with pytest.raises(ValueError, match="grouped-query"):
        attnkit.MultiHeadAttention(8, 4, num_kv_heads=2).to_torch()
    with pytest.raises(ValueError, match="head_dim == v_head_dim"):
        attnkit.MultiHeadAttention(8, 2, v_head_dim=3).to_torch()
    with pytest.raises(ValueError, match="add_bias_kv"):
        attnkit.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))


def test_module_equals_explicit_per_head_formula():
    """Separate q/k and v head sizes, GQA and cross-attention, against the float64 oracle."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4, kdim=6, vdim=9, num_kv_heads=2, head_dim=5, v_head_dim=3,
                                     dtype=torch.float64).eval()
    xq, xk, xv = torch.randn(2, 5, 16).double(), torch.randn(2, 7, 6).double(), torch.randn(2, 7, 9).double()
    key_mask = masks.padding([7, 3], 7)[:, 0, 0]
    out, w = mha(xq, xk, xv, key_mask=key_mask, need_weights=True)
    assert out.shape == (2, 5, 16) and w.shape == (2, 4, 5, 7)
    heads_q = [xq @ mha.q_proj.weight[i * 5:(i + 1) * 5].T + mha.q_proj.bias[i * 5:(i + 1) * 5] for i in range(4)]
    heads_k = [xk @ mha.k_proj.weight[j * 5:(j + 1) * 5].T + mha.k_proj.bias[j * 5:(j + 1) * 5] for j in range(2)]
    heads_v = [xv @ mha.v_proj.weight[j * 3:(j + 1) * 3].T + mha.v_proj.bias[j * 3:(j + 1) * 3] for j in range(2)]
    allowed = key_mask[:, None, None, :].expand(2, 1, 5, 7)
    per_head = [oracle.attention(heads_q[i][:, None], heads_k[i // 2][:, None], heads_v[i // 2][:, None],
                                 allowed=allowed)[0][:, 0] for i in range(4)]
    expected = torch.cat(per_head, dim=-1) @ mha.out_proj.weight.T + mha.out_proj.bias
    close(out, expected)


def test_share_kv_has_one_projection_and_self_attention_defaults():
    mha = attnkit.MultiHeadAttention(8, 2, share_kv=True)
    assert mha.v_proj is None
    n_shared = sum(p.numel() for p in mha.parameters())
    n_full = sum(p.numel() for p in attnkit.MultiHeadAttention(8, 2).parameters())
    assert n_full - n_shared == 8 * 8 + 8
    x = torch.randn(2, 3, 8)
    close(mha(x), mha(x, x, x))


def test_xavier_initialisation():
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(256, 8)
    std = (2.0 / (256 + 256)) ** 0.5  # Glorot normal
    for lin in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
        assert abs(lin.weight.std().item() - std) < 0.05 * std
        assert (lin.bias == 0).all()


def test_dropout_only_in_training():
    mha = attnkit.MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 6, 16)
    mha.eval()
    close(mha(x), mha(x))
    mha.train()
    torch.manual_seed(0)
    a = mha(x)
    torch.manual_seed(1)
    assert not torch.allclose(a, mha(x))
