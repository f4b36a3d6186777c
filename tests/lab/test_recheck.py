"""The lab's verdicts for heads, scaling, score_functions and rnn_conv, held against an independent
recheck (tests/support/lab_recheck.py, which does not import attnkit.lab): a verdict that claims more
than the recheck finds fails here."""

from __future__ import annotations

import pytest

from attnkit.lab import Finding, run_one
from tests.support import lab_recheck as recheck

NAMES = ("heads", "scaling", "score_functions", "rnn_conv")


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict[str, Finding]:
    out = tmp_path_factory.mktemp("lab_recheck")
    return {name: run_one(name, quick=True, out=out) for name in NAMES}


@pytest.fixture(scope="module")
def model():
    return recheck.minilm()


def test_heads_verdict_separates_delimiter_heads_and_matches_the_recheck(findings, model):
    f, fig = findings["heads"], findings["heads"].figures
    kinds = recheck.head_kinds(model)
    # The same model on other sentences: almost every head of one kind is a delimiter head.
    lab_share = fig["heads_delimiter"] / fig["heads_specialised"]
    assert abs(lab_share - kinds["delimiter"] / kinds["specialised"]) < 0.15
    assert abs(fig["delimiter_share_of_specialised"] - lab_share) < 1e-12
    assert abs(fig["heads_positional"] - kinds["positional"]) <= 3
    assert fig["heads_positional"] == fig["heads_previous"] + fig["heads_next"] + fig["heads_self"]
    # "bank" enters layer 0 as the same vector in both sentences.
    assert recheck.bank_layer0_inputs_differ(model) == 0.0 == fig["bank_layer0_input_difference"]
    # With a handful of positional heads, and the bank heads in layer 0 or moving with the control
    # word, "heads specialise" may not be called supported.
    thin = kinds["positional"] < 6 or kinds["self"] == 0
    bank_fragile = (fig["bank_top_heads_in_layer_0"] > 0 or fig["distinct_river_top_heads_over_controls"] > 1
                    or fig["distinct_china_top_heads_over_controls"] > 1)
    if thin or bank_fragile:
        assert f.verdict != "supported", f.why
    assert "delimiter" in f.why and "layer 0" in f.why
    assert f"{fig['heads_delimiter']} of the {fig['heads_specialised']}" in f.why
    assert len(fig["bank_by_control"]) == fig["bank_top_heads_compared"] // 2 >= 4


def test_scaling_verdict_states_the_q_gradient_and_the_initialisation(findings):
    f, fig = findings["scaling"], findings["scaling"].figures
    mine = recheck.scaling_recheck()
    lab = {row["d_k"]: row for row in fig["table"]}
    assert set(mine) == set(lab)
    for d, row in mine.items():  # the softmax's slope: autograd's Jacobian against the lab's formula
        assert abs(row["trace_scaled"] - lab[d]["trace_scaled"]) < 0.05
        assert abs(row["trace_unscaled"] - lab[d]["trace_unscaled"]) < 0.15
    assert mine[4096]["trace_unscaled"] < 0.1 < 0.9 < mine[4096]["trace_scaled"]
    assert fig["jacobian_trace_unscaled_4096"] < 0.1 < 0.9 < fig["jacobian_trace_scaled_4096"]
    # The gradient reaching q: larger unscaled at most d_k, in the lab's table and in the recheck.
    larger = sum(row["grad_q_unscaled"] > row["grad_q_scaled"] for row in mine.values())
    assert larger >= 3 and fig["grad_q_larger_unscaled"] >= 3
    assert fig["grad_q_larger_unscaled"] == sum(r["grad_q_unscaled"] > r["grad_q_scaled"] for r in fig["table"])
    # The training gap needs unit-variance q and k: with the default Xavier start both heads learn.
    assert fig["accuracy_scaled"] > fig["accuracy_unscaled"] + 0.3
    xavier_gap = fig["accuracy_scaled_xavier"] - fig["accuracy_unscaled_xavier"]
    if larger or xavier_gap < 0.1:
        assert f.verdict != "supported", f.why
    assert "gradient that reaches q is larger unscaled" in f.why and "Xavier" in f.why
    assert f"{fig['accuracy_unscaled_xavier']:.2f} unscaled from the default Xavier" in f.why


def test_score_functions_verdict_marks_an_untested_accuracy_claim(findings):
    f, fig = findings["score_functions"], findings["score_functions"].figures
    status = recheck.accuracy_claim_status({k: fig[f"accuracy_{k}"] for k in ("dot", "multiplicative", "additive")})
    if status != "holds":
        assert f.verdict != "supported", f.why
    if status == "untested":
        assert fig["accuracy_claim"].startswith("untested") and "untested" in f.why
    # The slowdown is stated as measured, with no fixed range.
    assert f"{fig['additive_vs_dot_time']:.1f}x" in f.why and "-200" not in f.why
    assert fig["additive_vs_dot_time"] == pytest.approx(fig["forward_ms_additive_n256"] / fig["forward_ms_dot_n256"],
                                                        rel=0.01)


def test_rnn_conv_counts_a_recurrent_step_as_torch_does(findings):
    f = findings["rnn_conv"]
    counted = recheck.rnn_flops(512, 64)
    assert counted == 4 * 512 * 64 * 64
    assert f.figures["flops_per_layer"]["recurrent"] == counted
    assert f"{counted:.2g}" in f.why


def test_the_recheck_itself_can_tell_claims_apart():
    assert recheck.accuracy_claim_status({"dot": 1.0, "multiplicative": 1.0, "additive": 0.995}) == "untested"
    assert recheck.accuracy_claim_status({"dot": 0.7, "multiplicative": 0.9, "additive": 0.95}) == "fails"
    assert recheck.accuracy_claim_status({"dot": 0.93, "multiplicative": 0.9, "additive": 0.95}) == "holds"
    assert recheck.rnn_flops(3, 8) == 4 * 3 * 8 * 8
