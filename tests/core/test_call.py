"""The validated call (:class:`attnkit.call.Call`) and what is worked out about it (:class:`attnkit.call.Derived`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnkit.call import Derived, validate_call


class _Seen:
    """A plan of a kind of its own that keeps the value tensor it was made from."""

    def __init__(self, value):
        self.value = value


def _call():
    g = torch.Generator().manual_seed(0)
    return validate_call(*(torch.randn(1, 2, 6, 4, generator=g) for _ in range(3)), is_causal=True)


def test_a_plan_is_made_once_per_call_kind_and_key():
    req, made = _call(), []

    def make(tag):
        made.append(tag)
        return _Seen(tag)

    first = req.derived.plan(_Seen, make, "a")
    assert req.derived.plan(_Seen, make, "b") is first and made == ["a"]
    assert req.derived.plan(_Seen, make, "c", key=(16,)).value == "c"  # another key: another plan
    assert req.mask_plan is req.mask_plan is req.derived.plan(type(req.mask_plan), None)


def test_a_call_copied_with_replace_starts_with_nothing_worked_out():
    """The NaN rule's sanitized call is the user's call with clean tensors, made with dataclasses.replace: a plan
    kept for the user's call (flex keeps q, k and v) must not reach it, or the clean call runs on the NaN."""
    req = _call()
    assert req.derived.plan(_Seen, _Seen, req.value).value is req.value
    clean = dataclasses.replace(req, value=torch.zeros_like(req.value))
    assert isinstance(clean.derived, Derived) and clean.derived is not req.derived
    assert clean.derived.plan(_Seen, _Seen, clean.value).value is clean.value
    with pytest.raises(ValueError, match="derived"):  # not an argument: it cannot be handed over either
        dataclasses.replace(req, derived=req.derived)


def test_a_plan_made_as_another_type_is_refused():
    with pytest.raises(TypeError, match="a _Seen plan was made as a str"):
        _call().derived.plan(_Seen, lambda: "text")


def test_after_an_in_place_write_only_the_plans_of_the_kinds_kept_stay():
    req = _call()
    plan = req.mask_plan
    req.derived.plan(_Seen, _Seen, "before the write")
    req.derived.forget_all_but(type(plan))
    assert req.mask_plan is plan
    assert req.derived.plan(_Seen, _Seen, "after the write").value == "after the write"
