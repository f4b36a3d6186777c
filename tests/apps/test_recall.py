"""attnkit.apps.recall at its QUICK size: the data holds its answer where it says, the three models
see the same batches and have about the same size, the checkpoint reloads to the same numbers,
the verdict says what the accuracies show, and the report holds its table and plots."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from attnkit.apps import recall
from attnkit.modules import MultiHeadAttention
from tests.support.apps_checks import report_embeds_pictures, same_seed_same_checkpoint
from tests.viz.test_report import app_report_problems

Q = {**recall.DEFAULTS, **recall.QUICK}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("recall")
    return recall.run(out=out, quick=True, progress=False), out


def test_the_answer_follows_the_only_cue_and_lies_distance_tokens_before_the_query():
    num_values, max_distance = 5, 9
    cue, query = recall.tokens(num_values)
    distance = torch.tensor([0, 1, 4, 9, 9, 3])
    seq, answer = recall.make_batch(distance, num_values, max_distance, torch.Generator().manual_seed(0))
    assert seq.shape == (6, max_distance + 3)
    for row, d, a in zip(seq.tolist(), distance.tolist(), answer.tolist(), strict=True):
        assert row.count(cue) == 1 and row.count(query) == 1 and row[-1] == query
        at = row.index(cue) + 1
        assert row[at] == a and 0 <= a < num_values
        assert len(row) - 1 - at - 1 == d  # tokens strictly between the answer and the query
        assert all(0 <= t < num_values for i, t in enumerate(row) if i not in (at - 1, len(row) - 1))
    with pytest.raises(ValueError, match="distance must be"):
        recall.make_batch(torch.tensor([10]), num_values, max_distance, torch.Generator())


def test_every_model_sees_the_same_batches_of_every_length():
    lengths = {recall.batch_for(step, 0, Q)[0].shape[1] for step in range(60)}
    assert lengths == set(range(Q["min_len"], Q["max_distance"] + 4))
    a, b = recall.batch_for(7, 0, Q), recall.batch_for(7, 0, Q)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], recall.batch_for(8, 0, Q)[0])
    assert not torch.equal(a[0], recall.batch_for(7, 1, Q)[0])


def test_the_three_models_have_about_the_same_size_and_attention_is_the_library_own():
    models = recall.build({k: recall.DEFAULTS[k] for k in recall.MODEL_KEYS})
    sizes = {name: recall.param_count(m) for name, m in models.items()}
    assert list(sizes) == list(recall.MODELS)
    assert max(sizes.values()) <= 1.15 * min(sizes.values()), sizes
    attn = [m for m in models["attention"].modules() if isinstance(m, MultiHeadAttention | torch.nn.MultiheadAttention)]
    assert len(attn) == recall.DEFAULTS["attn_layers"] and all(isinstance(m, MultiHeadAttention) for m in attn)
    seq, _ = recall.batch_for(0, 0, recall.DEFAULTS)
    for model in models.values():
        assert model(seq).shape == (len(seq), recall.DEFAULTS["num_values"])


@pytest.mark.parametrize("lstm_far, attn_far, words", [
    (0.3, 0.97, "The LSTM's accuracy falls with distance where attention's does not."),
    (0.95, 0.97, "Neither the LSTM's nor attention's accuracy falls with distance."),
    (0.3, 0.5, "Both the LSTM's and attention's accuracy fall with distance."),
    (0.95, 0.5, "Attention's accuracy falls with distance and the LSTM's does not."),
])
def test_the_verdict_says_what_the_accuracies_show(lstm_far, attn_far, words):
    acc = {"RNN": {0: 0.9, 64: 0.1}, "LSTM": {0: 1.0, 64: lstm_far}, "attention": {0: 1.0, 64: attn_far}}
    text = recall._verdict(acc, {"eval_distances": (0, 64), "steps": 10})
    assert words in text and f"LSTM 100% at distance 0, {lstm_far:.0%} at 64" in text


def test_a_step_is_timed_for_each_model():
    config = {k: Q[k] for k in recall.MODEL_KEYS}
    models = {name: recall.build_one(name, config) for name in recall.MODELS}
    times = recall.step_seconds(models, 8, 4, Q["num_values"], repeat=1)
    assert list(times) == list(recall.MODELS) and all(t > 0 for t in times.values())
    assert recall.cpu_name()


def test_the_quick_run_learns(trained):
    m = trained[0].metrics
    for name in recall.MODELS:
        assert m[f"{name} final loss (mean of 50)"] < 2.77  # ln 16: uniform over the values
    assert m["LSTM accuracy at distance 0"] > m["chance accuracy"]


def test_the_checkpoint_reloads_to_the_same_numbers_bit_for_bit(trained):
    result, out = trained
    models = recall.load(out)
    stored = load_file(out / "model.safetensors")
    assert stored.keys() == models.state_dict().keys()
    tests = recall.test_set(Q)
    near, far = Q["eval_distances"][0], Q["eval_distances"][-1]
    again = recall.load(out)
    for name in recall.MODELS:
        for d in (near, far):
            assert recall.accuracy(models[name], *tests[d]) == result.metrics[f"{name} accuracy at distance {d}"]
        with torch.no_grad():
            assert torch.equal(models[name](tests[far][0]), again[name](tests[far][0]))


def test_the_report_holds_the_table_and_plots(trained):
    result, out = trained
    assert sorted(report_embeds_pictures(result, out)) == ["recall_accuracy.png", "recall_step_time.png"]
    acc, times = result.sections
    assert [row["Distance"] for row in acc.table] == list(Q["eval_distances"])
    assert [row["Length"] for row in times.table] == list(Q["time_lengths"])
    assert recall.cpu_name() in times.text


def test_same_seed_same_checkpoint(tmp_path):
    same_seed_same_checkpoint(recall, tmp_path)


def test_the_report_shows_labels_for_people(trained):
    result, _ = trained
    assert app_report_problems(result) == []
    rows = {row["Metric"]: row["Value"] for row in result.evaluation_rows()}
    assert rows["Attention accuracy at distance 0"] == result.metrics["attention accuracy at distance 0"]
