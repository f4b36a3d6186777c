"""Mask plans are never read stale: the cache of ``attnkit.attention(..., mask_mod=fn)`` (and the
score probe's record of a score_mod's form) sees what the mod reaches (a bound module's buffers,
tensor and plain attributes, closure values), and a :class:`attnkit.MaskPlan` cannot be changed
after it is built nor used with intervals the kernels cannot take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit import maskplan
from attnkit.maskplan import plan as plan_module
from attnkit.maskplan import plan_cache
from tests.support import oracle
from tests.support.tolerances import close

L = 12
BACKENDS = ("reference", "band", "tiles")


def qkv(seed: int = 0, length: int = L):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, length, 4, generator=g, dtype=torch.float64) for _ in range(3))


def expect(q, k, v, mod) -> torch.Tensor:
    """The float64 oracle's output, the mask read cell by cell from the predicate as it is now."""
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    return oracle.attention(q, k, v, allowed=oracle.allowed_grid(b, h, lq, lk, mask_mod=mod))[0]


class Documents(torch.nn.Module):
    """A model part whose mask reads a buffer, a plain tensor attribute, a submodule's buffer and an int."""

    def __init__(self):
        super().__init__()
        self.register_buffer("docs", torch.tensor([0] * 6 + [1] * 6))
        self.group = torch.zeros(L, dtype=torch.long)  # a plain tensor attribute, not a buffer
        self.inner = torch.nn.Module()
        self.inner.register_buffer("dead", torch.zeros(L, dtype=torch.bool))
        self.reach = L  # a plain int: keys further than this are masked

    def mask(self, b, h, i, j):
        return ((self.docs[i] == self.docs[j]) & (self.group[i] == self.group[j]) & ~self.inner.dead[j]
                & ((i - j).abs() < self.reach))

    def forward(self, b, h, i, j):
        return self.mask(b, h, i, j)


def edits(m: Documents):
    """Each way a module's mask state changes between calls."""
    yield "a buffer edited in place", lambda: m.docs[3:].fill_(1)
    yield "a buffer reassigned", lambda: setattr(m, "docs", torch.tensor([0] * 9 + [1] * 3))
    yield "a plain tensor attribute edited in place", lambda: m.group[8:].fill_(1)
    yield "a plain tensor attribute reassigned", lambda: setattr(m, "group", torch.arange(L) % 2)
    yield "a submodule's buffer edited in place", lambda: m.inner.dead[[0, 5]].fill_(True)
    yield "an int attribute changed", lambda: setattr(m, "reach", 3)


@pytest.mark.parametrize("as_mod", ["bound method", "the module itself"])
def test_a_module_predicate_sees_every_change_of_the_module_state(as_mod):
    m = Documents()
    mod = m.mask if as_mod == "bound method" else m  # kept: the cache holds a plan per predicate object
    q, k, v = qkv()
    close(attnkit.attention(q, k, v, mask_mod=mod), expect(q, k, v, mod))
    for what, change in edits(m):
        change()
        for backend in ("band", "tiles"):
            got = attnkit.attention(q, k, v, mask_mod=mod, backend=backend)
            close(got, expect(q, k, v, mod), msg=lambda text, what=what, backend=backend: f"{what}, {backend}: {text}")


class TrainingOnly(torch.nn.Module):
    """A mask that reads the training flag: in training only the diagonal."""

    def mask(self, b, h, i, j):
        return (i == j) if self.training else (j <= i)


def test_a_predicate_reading_the_training_flag_follows_it():
    m = TrainingOnly()
    mod = m.mask
    q, k, v = qkv(1)
    close(attnkit.attention(q, k, v, mask_mod=mod), expect(q, k, v, mod))
    m.eval()
    close(attnkit.attention(q, k, v, mask_mod=mod), expect(q, k, v, mod))


def test_a_closure_over_a_number_sees_the_number_change():
    width = 2

    def mod(b, h, i, j):
        return (i - j).abs() <= width

    q, k, v = qkv(2)
    close(attnkit.attention(q, k, v, mask_mod=mod), expect(q, k, v, mod))
    width = 5  # noqa: F841 - read by mod through its closure cell
    close(attnkit.attention(q, k, v, mask_mod=mod), expect(q, k, v, mod))


def test_a_fresh_tensor_at_a_freed_tensors_address_does_not_bring_back_its_plan():
    """Reassigned ids are freed and the allocator may hand their memory to the next ones: the same
    address, the same version (0) and the same shape as a tensor whose plan is still cached. Made
    certain here by giving each round's new tensor the same numpy memory; the cache must tell the
    tensors apart."""
    m = Documents()
    mod = m.mask
    q, k, v = qkv(3)
    memory = np.zeros(L, dtype=np.int64)
    for r in range(5):
        memory[:] = [0] * (r + 2) + [1] * (L - r - 2)  # the previous round's tensor is gone with the reassignment
        m.docs = torch.from_numpy(memory)
        close(attnkit.attention(q, k, v, mask_mod=mod, backend="band"), expect(q, k, v, mod))


def test_with_the_cache_off_an_edit_it_cannot_see_is_followed(monkeypatch):
    """An edit through ``.data`` leaves the version counter as it was (documented as unseen by the
    cache); with ``PLANS_PER_PREDICATE = 0`` every call builds its plan."""
    docs = torch.tensor([0] * 6 + [1] * 6)

    def mod(b, h, i, j):
        return docs[i] == docs[j]

    q, k, v = qkv(4)
    monkeypatch.setattr(plan_cache, "PLANS_PER_PREDICATE", 0)
    close(attnkit.attention(q, k, v, mask_mod=mod), expect(q, k, v, mod))
    docs.data[2:] = 1
    close(attnkit.attention(q, k, v, mask_mod=mod), expect(q, k, v, mod))
    assert mod not in plan_cache._cache


class DiagonalBias(torch.nn.Module):
    """A score_mod that is a bias per head and diagonal (the band kernel's form) until ``doubled`` is set."""

    def __init__(self):
        super().__init__()
        self.register_buffer("slopes", torch.tensor([0.5, 0.25]))
        self.doubled = False

    def score(self, score, b, h, q, kv):
        out = score + (kv - q).to(score.dtype) * self.slopes[h]
        return out * 2 if self.doubled else out


def test_a_score_mod_checked_as_a_diagonal_bias_is_checked_again_when_a_value_it_reads_changes():
    m = DiagonalBias()
    mod = m.score
    q, k, v = qkv(11)
    for doubled in (False, True):  # True: no longer the score plus a bias; the probe must not be reused
        m.doubled = doubled
        want = oracle.attention(q, k, v, allowed=oracle.allowed_grid(1, 2, L, L, is_causal=True), score_mod=mod)[0]
        close(attnkit.attention(q, k, v, score_mod=mod, is_causal=True), want)


# ---- a MaskPlan cannot change once built ---------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_written_in_place_is_refused_by_every_backend(backend):
    p = attnkit.mask_plan(lambda b, h, i, j: j <= i, q_len=L)
    q, k, v = qkv(5)
    close(attnkit.attention(q, k, v, mask=p, backend=backend), attnkit.attention(q, k, v, is_causal=True,
                                                                                backend="reference"))
    p.starts[0, 8:, 0] = 5  # the band kernel would follow this, the others the predicate
    with pytest.raises(ValueError, match=r"starts/ends were written in place .*version counters \(0, 0\) -> "
                                         r"\(1, 0\).*build a new plan"):
        attnkit.attention(q, k, v, mask=p, backend=backend)


def test_a_plan_intervals_cannot_be_reassigned():
    p = attnkit.mask_plan(q_len=L, is_causal=True)
    for name in ("starts", "ends"):
        with pytest.raises(AttributeError, match="starts and ends are fixed when it is built"):
            setattr(p, name, torch.zeros(1, L, 1, dtype=torch.long))


def test_a_cached_plan_written_in_place_through_the_request_is_refused():
    from attnkit.call import validate_call

    docs = torch.tensor([0] * 6 + [1] * 6)
    mod = lambda b, h, i, j: docs[i] == docs[j]  # noqa: E731
    q, k, v = qkv(6)
    attnkit.attention(q, k, v, mask_mod=mod)
    validate_call(q, k, v, mask_mod=mod).mask_plan.ends[0, 0, 0] = 1
    with pytest.raises(ValueError, match="written in place"):
        attnkit.attention(q, k, v, mask_mod=mod)


def test_a_plan_built_under_inference_mode_sees_a_write_made_there():
    q, k, v = qkv(7)
    with torch.inference_mode():
        p = attnkit.mask_plan(q_len=L, is_causal=True)
        attnkit.attention(q, k, v, mask=p)
        p.ends[0, 4, 0] = 1
        with pytest.raises(ValueError, match="written in place"):
            attnkit.attention(q, k, v, mask=p)


# ---- intervals given to MaskPlan are checked where the plan meets a call ------------------------


def user_plan(starts, ends, *, batch: int = 1, heads: int | None = None, predicate=None) -> maskplan.MaskPlan:
    return maskplan.MaskPlan(predicate, q_len=L, kv_len=L, batch=batch, heads=heads, device=torch.device("cpu"),
                         starts=starts, ends=ends)


def causal_rows():
    return torch.zeros(1, L, 1, dtype=torch.long), torch.arange(1, L + 1).view(1, L, 1)


def bad_plans():
    s, e = causal_rows()
    past = e.clone()
    past[0, 3, 0] = 7813  # the tiles backend's IndexError of the issue
    two_s, two_e = torch.cat([s, s + 4], -1), torch.cat([e.clamp(max=3), e + 4], -1).clamp(max=L)
    overlapping = torch.cat([s, s + 2], -1), torch.cat([e, e + 2], -1).clamp(max=L)
    empty_first = two_s.clone(), two_e.clone()
    empty_first[0][0, 0, 0], empty_first[1][0, 0, 0] = L, L  # an empty slot before a live one
    empty_inside = s.clone(), e.clone()
    empty_inside[0][0, 2, 0], empty_inside[1][0, 2, 0] = 2, 2  # an empty one not written (Lk, Lk)
    negative = s.clone() - 1, e
    backwards = e.clone(), s.clone() + 0
    return {
        "int32 starts": ((s.int(), e), TypeError, "starts must be an int64 CPU tensor, got torch.int32"),
        "K = 0": ((s[..., :0], e[..., :0]), ValueError, r"shape \[P, Lq=12, K >= 1\], got \(1, 12, 0\)"),
        "2-D": ((s[0], e[0]), ValueError, r"starts must have shape \[P, Lq=12, K >= 1\], got \(12, 1\)"),
        "rows of another Lq": ((s[:, :5], e[:, :5]), ValueError, r"got \(1, 5, 1\)"),
        "starts and ends of two shapes": ((s, two_e), ValueError, "starts and ends must have the same shape"),
        "an end past kv_len": ((s, past), ValueError, r"interval 0 of row 3 .* is \[0, 7813\); expected 0 <= start "
                                                      r"<= end <= kv_len = 12"),
        "a negative start": (negative, ValueError, r"is \[-1, 1\); expected 0 <= start"),
        "start after end": (backwards, ValueError, r"interval 0 of row 0 .* is \[1, 0\)"),
        "overlapping": (overlapping, ValueError, r"row 2 .* not sorted and disjoint: \[0, 3\) then \[2, 5\)"),
        "an empty slot before a live one": (empty_first, ValueError, "not sorted and disjoint"),
        "an empty slot not written (Lk, Lk)": (empty_inside, ValueError, r"is \[2, 2\).*written \(12, 12\)"),
        "P of neither 1, B nor B*H": ((s.expand(3, L, 1), e.expand(3, L, 1)), ValueError,
                                      r"P = 3\); expected P in \(1,\)"),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(bad_plans()))
def test_unsound_intervals_are_refused_with_a_named_error_by_every_backend(case, backend):
    (starts, ends), error, message = bad_plans()[case]
    q, k, v = qkv(8)
    with pytest.raises(error, match=message):
        attnkit.attention(q, k, v, mask=user_plan(starts, ends, predicate=lambda b, h, i, j: j <= i),
                          backend=backend)


def test_sound_intervals_given_by_hand_are_checked_once_then_in_constant_time(monkeypatch):
    calls = []
    real = maskplan.check_intervals
    monkeypatch.setattr(plan_module, "check_intervals", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    # per batch element, per head: P = B*H = 4 (batch 2, heads 2), padding rows of 3 lengths
    lengths = torch.tensor([3, 12, 7, 1])
    s = torch.zeros(4, L, 1, dtype=torch.long)
    e = lengths.view(4, 1, 1).expand(4, L, 1).contiguous()
    p = user_plan(s, e, batch=2, heads=2, predicate=lambda b, h, i, j: j < lengths[b * 2 + h])
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, L, 4, generator=g, dtype=torch.float64) for _ in range(3))
    want = oracle.attention(q, k, v, allowed=(torch.arange(L) < lengths.view(2, 2, 1, 1)).expand(2, 2, L, L))[0]
    for backend in ("band", "tiles", "reference"):
        close(attnkit.attention(q, k, v, mask=p, backend=backend), want)
    assert calls == [1]  # once, at the first call; O(1) after


def test_plans_that_the_engine_builds_are_not_checked_again(monkeypatch):
    calls = []
    monkeypatch.setattr(plan_module, "check_intervals", lambda *a, **kw: calls.append(1))
    q, k, v = qkv(10)
    p = attnkit.mask_plan(lambda b, h, i, j: (i - j).abs() <= 2, q_len=L)
    attnkit.attention(q, k, v, mask=p)
    attnkit.attention(q, k, v, mask_mod=lambda b, h, i, j: j <= i)
    assert calls == []
