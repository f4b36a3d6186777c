"""FlexAttention's per-element semantics: mods written for vmapped scalar indices give the result
a per-cell loop gives, on every backend; mods that broadcast are called as they are."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import per_element
from tests.support.tolerances import close

B, H, L, S, E = 2, 2, 11, 13, 4


def loop_oracle(q, k, v, mask_mod=None, score_mod=None):
    """softmax(score_mod(q k^T / sqrt(E)) masked) v, one Python call of each mod per cell, in float64."""
    out = torch.zeros(B, H, L, E, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = q[b, h] @ k[b, h].T / E**0.5
            for i in range(L):
                for j in range(S):
                    idx = (torch.tensor(b), torch.tensor(h), torch.tensor(i), torch.tensor(j))
                    if score_mod is not None:
                        s[i, j] = score_mod(s[i, j], *idx)
                    if mask_mod is not None and not bool(mask_mod(*idx)):
                        s[i, j] = float("-inf")
            out[b, h] = torch.softmax(s, -1).nan_to_num(0.0) @ v[b, h]
    return out


def flexattention_mods(g):
    # Flamingo-style cross-attention: each text token sees the keys of its image's interval.
    intervals = torch.tensor([[0, 5], [5, 9], [9, 13]])
    image_idx = torch.tensor([0] * 4 + [1] * 4 + [2] * 3)

    def flamingo(b, h, q_idx, kv_idx):
        interval = intervals[image_idx[q_idx]]
        return (kv_idx >= interval[0]) & (kv_idx < interval[1])

    # MLA-style decoupled RoPE: a score term from a dot product of per-token rotary parts.
    query_rope = torch.randn(B, H, L, 3, generator=g, dtype=torch.float64)
    key_rope = torch.randn(B, H, S, 3, generator=g, dtype=torch.float64)

    def mla(score, b, h, q_idx, kv_idx):
        return score + torch.dot(query_rope[b, h, q_idx], key_rope[b, h, kv_idx])

    return flamingo, mla


BACKENDS = ("auto", "reference", "tiles", "fused_tiles")


@pytest.mark.parametrize("backend, which", [  # the fused kernel takes no score_mod
    (backend, which) for which in ("flamingo", "mla", "both") for backend in BACKENDS
    if backend != "fused_tiles" or which == "flamingo"])
def test_mods_written_per_element_give_the_per_cell_result(backend, which):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, E, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, H, S, E, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    flamingo, mla = flexattention_mods(g)
    kw = {"flamingo": {"mask_mod": flamingo}, "mla": {"score_mod": mla},
          "both": {"mask_mod": flamingo, "score_mod": mla}}[which]
    out = attnkit.attention(q, k, v, backend=backend, **kw)
    close(out, loop_oracle(q.detach(), k.detach(), v.detach(), **kw))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.autograd.grad(attnkit.attention(q, k, v, backend="reference", **kw).sum(), (q, k, v))
    for a, b in zip(grads, ref, strict=True):
        close(a, b)


def test_the_flamingo_mask_reaches_the_banded_kernel():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, n, E, generator=g, dtype=torch.float64) for n in (L, S, S))
    flamingo, _ = flexattention_mods(g)
    assert attnkit.which_backend(q, k, v, mask_mod=flamingo) == "band"


def test_broadcasting_mods_are_called_as_they_are_and_the_decision_is_made_once():
    calls = []

    def causal(b, h, q_idx, kv_idx):
        calls.append(q_idx.shape)
        return kv_idx <= q_idx

    grid = (3, 3, 3, 3)
    assert per_element.evaluator(causal, grid, "cpu") is causal
    made = len(calls)
    assert per_element.evaluator(causal, grid, "cpu") is causal
    assert len(calls) == made  # decided once per mod

    def branchy(b, h, q_idx, kv_idx):  # Python control flow on a value: vmap cannot run it
        return kv_idx <= q_idx if bool((q_idx >= 0).all()) else kv_idx < 0

    assert per_element.evaluator(branchy, grid, "cpu") is branchy


def test_attnkit_own_mods_are_used_as_they_are_and_a_users_part_inside_them_is_still_checked():
    from attnkit import masks, scores

    own = masks.and_masks(masks.causal_mod(), masks.window_mod(2, 0))
    assert per_element.broadcasts(own) and per_element.evaluator(own, (3, 3, 3, 3), "cpu") is own
    alibi = scores.alibi(scores.alibi_slopes(2))
    assert per_element.evaluator(alibi, (3, 3, 3, 3), "cpu", torch.float32) is alibi
    # a per-element (Flamingo-style) part makes the combination one to check: it is still exact
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, L, E, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, S, E, generator=g, dtype=torch.float64) for _ in range(2))
    flamingo, mla = flexattention_mods(g)
    mixed = masks.and_masks(flamingo, masks.window_mod(None, 3, offset=S - L))
    assert not per_element.broadcasts(mixed)
    score = scores.compose(alibi, mla)
    assert not per_element.broadcasts(score)
    for backend in ("auto", "reference"):
        close(attnkit.attention(q, k, v, mask_mod=mixed, score_mod=score, backend=backend),
              loop_oracle(q, k, v, mask_mod=mixed, score_mod=score))


def test_per_element_wrapper_keeps_shapes_and_dtypes():
    wrapped = per_element.per_element(lambda s, b, h, i, j: s + (i - j))
    s = torch.zeros(2, 1, 3, 4, dtype=torch.float32)
    i, j = torch.arange(3).view(1, 1, -1, 1), torch.arange(4).view(1, 1, 1, -1)
    out = wrapped(s, torch.zeros(()), torch.zeros(()), i, j)
    assert out.shape == (2, 1, 3, 4) and out.dtype == torch.float32
    assert torch.equal(out[0, 0], (i - j)[0, 0].float())
    empty = wrapped(torch.zeros(0, 1, 3, 4), torch.zeros(()), torch.zeros(()), i, j)
    assert empty.shape == (0, 1, 3, 4)


def test_a_plan_built_by_hand_reads_a_per_element_mod_the_same_way():
    g = torch.Generator().manual_seed(2)
    flamingo, _ = flexattention_mods(g)
    plan = attnkit.mask_plan(flamingo, q_len=L, kv_len=S, batch=B, heads=H)
    q, k, v = (torch.randn(B, H, n, E, generator=g, dtype=torch.float64) for n in (L, S, S))
    close(attnkit.attention(q, k, v, mask=plan), loop_oracle(q, k, v, mask_mod=flamingo))


def test_asking_about_a_mod_does_not_keep_it_or_its_tensors_alive():
    import gc
    import weakref

    def make():
        big = torch.zeros(1000)
        return (lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + big[0].long()), weakref.ref(big)

    mod, tensor_gone = make()
    per_element.evaluator(mod, (3, 3, 3, 3), "cpu")
    gone = weakref.ref(mod)
    del mod
    gc.collect()
    assert gone() is None and tensor_gone() is None
