"""The benchmark suites' shared tools (the suites themselves are programs, run by hand)."""

from __future__ import annotations

import itertools
import re

from attnkit.bench._util import interleaved_medians, median_time, progress


def test_progress_goes_to_stderr_with_the_elapsed_time(capsys):
    say = progress("blockwise")
    say("sliding window, forward")
    out, err = capsys.readouterr()
    assert out == ""
    assert re.fullmatch(r"attnkit bench blockwise: sliding window, forward \(\d+ s\)\n", err)


def test_timing_helpers_use_the_clock_they_are_given():
    ticks = itertools.count(0.0, 0.5)  # every reading 0.5 s after the last: each call lasts 0.5 s
    calls = []
    assert median_time(lambda: calls.append(1), repeat=3, warmup=2, clock=lambda: next(ticks)) == 0.5
    assert len(calls) == 5
    fake = itertools.count(0.0, 1.0)
    res = interleaved_medians({"a": lambda: None, "b": lambda: None}, repeat=3, warmup=1, clock=lambda: next(fake))
    assert res == {"a": 1.0, "b": 1.0}


def test_interleaved_rounds_can_alternate_their_order():
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "ab"}
    interleaved_medians(fns, repeat=3, warmup=0, alternate=True)
    assert order == ["a", "b", "b", "a", "a", "b"]
    order.clear()
    interleaved_medians(fns, repeat=2, warmup=0)
    assert order == ["a", "b", "a", "b"]
