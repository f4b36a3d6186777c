"""attnkit.apps.tag at its QUICK size: the labels tokenize and ast give, the baselines, the
overlapping-window prediction, the run's report and checkpoint."""

from __future__ import annotations

import pytest
import torch

from attnkit.apps import tag
from attnkit.modules import MultiHeadAttention
from tests.viz.test_report import app_report_problems


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tag")
    return tag.run(out=out, quick=True, progress=False), out


def test_each_name_gets_its_role_from_the_syntax_tree():
    src = "import os as o\nclass A(B):\n    def f(self, x=1):\n        y = g(x, k=x)\n        return self.y\n"
    got = [(text, t) for text, _, t in tag.tag_source(src) if t is not None]
    assert got == [
        ("import", "keyword"), ("os", "imported name"), ("as", "keyword"), ("o", "other name"),
        ("class", "keyword"), ("A", "class name"), ("(", "operator"), ("B", "variable read"), (")", "operator"),
        (":", "operator"),
        ("def", "keyword"), ("f", "function name"), ("(", "operator"), ("self", "parameter"), (",", "operator"),
        ("x", "parameter"), ("=", "operator"), ("1", "number"), (")", "operator"), (":", "operator"),
        ("y", "variable assigned"), ("=", "operator"), ("g", "variable read"), ("(", "operator"),
        ("x", "variable read"), (",", "operator"), ("k", "keyword argument"), ("=", "operator"),
        ("x", "variable read"), (")", "operator"),
        ("return", "keyword"), ("self", "variable read"), (".", "operator"), ("y", "attribute")]
    layout = [text for text, _, t in tag.tag_source(src) if t is None]
    assert layout.count("<newline>") == 5 and layout.count("<indent>") == 2 and "<dedent>" in layout


def test_the_per_token_majority_counts_training_tags():
    ids = torch.tensor([5, 5, 5, 6, 7, 7])
    tags = torch.tensor([1, 1, 2, 3, tag.IGNORE, 0])
    table = tag.per_token_majority(ids, tags, 9)
    assert table[5] == 1 and table[6] == 3 and table[7] == 0
    assert table[8] == 1  # never seen: the commonest tag of all


def test_every_token_is_predicted_from_the_window_where_it_has_most_room():
    class Echo(torch.nn.Module):  # "predicts" each token's position inside its window, as a tag id
        def forward(self, ids):
            return torch.nn.functional.one_hot(torch.arange(ids.shape[1]).expand(ids.shape[0], -1), 64).float()

    pred = tag.predict(Echo(), torch.zeros(50, dtype=torch.long), window=8)
    # Windows start at 0, 4, 8, ..., 40, 42 (half a window apart, the last flush with the end): a token
    # away from the stream's ends has at least a quarter of the window (2) on each side of it.
    assert pred[:3].tolist() == [0, 1, 2] and pred[-3:].tolist() == [5, 6, 7]
    assert set(pred[4:-4].tolist()) == {2, 3, 4, 5}


def test_the_run_scores_tagger_and_baselines_per_tag(trained):
    result, _ = trained
    m = result.metrics
    assert m["test tokens"] > 1000
    for name in ("Transformer tagger", "per-token majority", "majority tag"):
        assert 0.0 <= m[f"accuracy {name}"] <= 1.0
    assert m["accuracy per-token majority"] > m["accuracy majority tag"]
    assert m["last loss"] < 0.7 * m["first loss"]
    per_tag = {row["Tag"]: row for row in result.sections[1].table}
    assert sum(row["Tokens"] for row in per_tag.values()) == m["test tokens"]
    assert per_tag["operator"]["Per-token majority"] == 1.0  # an operator's text is its tag
    assert app_report_problems(result) == []


def test_the_checkpoint_reloads_and_its_attention_is_the_library_own(trained):
    result, out = trained
    model = tag.load(out)
    assert all(isinstance(m, MultiHeadAttention) for m in model.modules()
               if isinstance(m, MultiHeadAttention | torch.nn.MultiheadAttention))
    assert (out / "tag_attention.png").read_bytes().startswith(b"\x89PNG")
    assert [p.name for s in result.sections for p in s.images] == ["tag_attention.png"]
