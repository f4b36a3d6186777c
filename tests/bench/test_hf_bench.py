"""`attnkit bench hf --quick`: every family of the matrix runs on "attnkit" and on its anchor, prefill and decode,
and attnkit's outputs are the anchor's within the tolerance table (nothing is asserted about speed)."""

from __future__ import annotations

import pytest

from tests.support.tolerances import MODEL_PARITY, close

pytest.importorskip("transformers")


@pytest.mark.slow
def test_the_quick_matrix_gives_the_anchors_outputs_for_every_family_and_phase():
    from attnkit.bench import hf

    said = []
    rows, outputs = hf.measure(quick=True, say=said.append)
    want = {(f.name, "prefill") for f in hf.FAMILIES} | {(f.name, "decode") for f in hf.FAMILIES if f.decoder}
    assert {(name, phase) for name, phase, *_ in outputs} == want
    assert len(rows) == len(outputs) == len(said)
    for name, phase, got, anchor, mask, dtype in outputs:
        keep = mask.bool()  # the real positions: a padded one is read by no real token
        assert got.shape == anchor.shape and keep.shape == got.shape[:2], (name, phase)
        try:
            close(got[keep], anchor[keep], dtype, **MODEL_PARITY[dtype])
        except AssertionError as error:
            raise AssertionError(f"{name}, {phase}: {error}") from None
    assert all(row[hf.HEADER.index("attnkit speed-up")] > 0 for row in rows)
    # every cell's attention functions were timed (the clock saw both names' calls), and put back afterwards
    assert all(row[hf.HEADER.index("attention speed-up")] > 0 for row in rows)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from attnkit.integrations.transformers import attnkit_attention_forward
    assert ALL_ATTENTION_FUNCTIONS["attnkit"] is attnkit_attention_forward
    step = hf.decode_step(quick=True, say=said.append)  # the decode step alone, against one read of the cache
    assert [row[0] for row in step] == ["float32", "bfloat16"] and all(row[5] > 0 for row in step)


def test_the_attention_clock_times_a_nested_call_once_and_puts_every_function_back(monkeypatch):
    """An attention function that calls another registered one is timed once (the outer call), and leaving the
    clock's block restores the registrations as they were (no local override left behind)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from attnkit.bench import hf

    AttentionInterface.register("attnkit_test_inner", lambda *a, **k: "inner")
    AttentionInterface.register("attnkit_test_outer", lambda *a, **k: ALL_ATTENTION_FUNCTIONS["attnkit_test_inner"]())
    before = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS}
    ticks = iter(range(100))
    monkeypatch.setattr(hf.time, "process_time", lambda: float(next(ticks)))  # each reading one tick later
    with hf._AttentionClock("transformers.models.llama.modeling_llama") as clock:
        assert ALL_ATTENTION_FUNCTIONS["attnkit_test_outer"]() == "inner"
        assert clock.spent == 1.0  # the outer call's two readings (0, 1); the inner call reads none
    assert {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS} == before
    AttentionInterface.register("attnkit_test_inner", lambda *a, **k: "re-registered")  # a later registration shows
    assert ALL_ATTENTION_FUNCTIONS["attnkit_test_inner"]() == "re-registered"
