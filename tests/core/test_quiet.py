"""attnkit says what it has to say through ``warnings`` (what a user should act on) and ``logging`` (the
rest), which a user can filter and route; the library never prints to stdout or stderr."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch

import attnkit
from attnkit.backends import flex

#: Calls a user makes first: a window, causal, bfloat16, weights, a score_mod, each forward and backward.
FIRST_CALLS = textwrap.dedent("""
    import torch, attnkit
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g, requires_grad=True) for _ in range(3))
    outs = [attnkit.attention(q, k, v, window=(8, 0)), attnkit.attention(q, k, v, is_causal=True),
            attnkit.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True).float(),
            attnkit.attention(q, k, v, return_weights=True)[0],
            attnkit.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + (j - i) * 0.1, backend="tiles")]
    sum(o.sum() for o in outs).backward()
    with torch.no_grad():
        attnkit.attention(q, k, v, window=(8, 0), backend="band")
""")


@pytest.mark.slow
def test_importing_and_calling_attnkit_prints_nothing_and_warns_nothing():
    """A fresh process with every warning an error (``python -W error``), as the issue's reader would run it."""
    done = subprocess.run([sys.executable, "-W", "error", "-c", FIRST_CALLS], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


def test_flex_compiling_and_falling_back_prints_nothing_but_logs_and_warns(monkeypatch, capfd, said):
    """What flex says of a compile (logged, INFO) and of a family it cannot serve (a warning: the user may pick
    another backend) reaches logging and warnings, and nothing is printed."""
    made = []

    def compile_(lse=False, dynamic=False):
        made.append(1)

        def kernel(*args):
            raise RuntimeError("no C++ compiler found")
        return kernel

    monkeypatch.setattr(flex, "_compile", compile_)
    monkeypatch.setattr(flex, "_failed", {})
    monkeypatch.setattr(flex, "_families", OrderedDict())
    q, k, v = (torch.randn(1, 2, 19, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.no_grad():
        attnkit.attention(q, k, v, is_causal=True, backend="flex")
    assert made and capfd.readouterr() == ("", "")
    text = said()
    assert "attnkit: compiling PyTorch's flex_attention for torch.float32" in text
    assert "compiled flex_attention cannot serve this call (RuntimeError: no C++ compiler found); the sdpa " \
        "backend serves it" in text
