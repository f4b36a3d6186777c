"""attnkit.apps.graph at its QUICK size: the karate club and its split, the graph layer against a
plain-PyTorch GAT and against the plain mean, the run's report, checkpoint and picture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.apps import graph
from attnkit.viz.report import report_html
from tests.support.tolerances import MODEL_PARITY, close
from tests.viz.test_report import app_report_problems


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("graph")
    return graph.run(out=out, quick=True, progress=False), out


def test_the_karate_club_and_its_fixed_split():
    adj, labels = graph.karate()
    assert adj.shape == (34, 34) and torch.equal(adj, adj.T) and adj.diagonal().all()
    assert (adj.sum() - 34) // 2 == 78  # Zachary's 78 friendships
    assert labels.bincount().tolist() == [17, 17]
    train, test = graph.split(labels)
    assert labels[train].bincount().tolist() == [graph.TRAIN_PER_CLASS] * 2
    assert sorted(train.tolist() + test.tolist()) == list(range(34))
    assert torch.equal(graph.split(labels)[0], train)  # fixed, whatever the run's seed


def _plain_gat(layer: graph.GraphAttention, x, adj):
    """The GAT layer as the paper writes it, in float64, one head at a time."""
    w = layer.proj.weight.double()
    out = []
    for h in range(layer.num_heads):
        wh = x.double() @ w[h * layer.out_dim:(h + 1) * layer.out_dim].T  # (N, D)
        e = F.leaky_relu(wh @ layer.att_dst[h].double()[:, None] + (wh @ layer.att_src[h].double())[None, :], 0.2)
        a = e.masked_fill(~adj, float("-inf")).softmax(-1)
        out.append(a @ wh)
    return torch.cat(out, -1) + layer.bias.double()


def test_the_layer_is_the_gat_formula_and_the_mean_is_attention_with_equal_scores():
    torch.manual_seed(0)
    adj, _ = graph.karate()
    x = torch.randn(34, 5)
    gat = graph.GraphAttention(5, 3, 2, learn_scores=True, concat=True)
    out, weights = gat(x, adj)
    close(out, _plain_gat(gat, x, adj), torch.float32, **MODEL_PARITY[torch.float32])
    assert weights.shape == (2, 34, 34) and (weights[:, ~adj] == 0).all()
    close(weights.sum(-1), torch.ones(2, 34))
    mean = graph.GraphAttention(5, 3, 2, learn_scores=False, concat=False)
    out, weights = mean(x, adj)
    h = mean.proj(x).view(34, 2, 3).mean(1)  # heads averaged, then neighbours: the order does not matter
    close(out, (adj.float() @ h) / adj.sum(-1, keepdim=True) + mean.bias, torch.float32, **MODEL_PARITY[torch.float32])
    close(weights[0], adj.float() / adj.sum(-1, keepdim=True))
    assert graph.evenness(weights, adj) == pytest.approx(1.0)


def test_the_run_reports_every_model_and_a_verdict(trained):
    result, _ = trained
    m = result.metrics
    assert m["seeds"] == graph.QUICK["seeds"] and m["test nodes"] == 34 - 2 * graph.TRAIN_PER_CLASS
    for kind in graph.MODELS:
        assert 0.0 <= m[f"{kind} accuracy"] <= 1.0
    # Identity features: without the edges the test nodes are unknown; with them, most are right.
    assert m["mean accuracy"] > m["mlp accuracy"] + 0.2
    assert m["gat accuracy"] > m["mlp accuracy"] + 0.2
    text = result.sections[0].text
    assert "attention" in text and ("not told apart" in text or "exceeds two standard errors" in text)
    assert app_report_problems(result) == []


def test_the_checkpoint_reloads_and_the_picture_is_in_the_report(trained):
    result, out = trained
    model = graph.load(out)
    adj, labels = graph.karate()
    with torch.no_grad():
        _, weights = model(torch.eye(34), adj)
    assert graph.evenness(weights[0], adj) == result.metrics["evenness"]  # the model the report drew
    images = [p for s in result.sections for p in s.images]
    assert [p.name for p in images] == ["graph_attention.png"]
    assert (out / "graph_attention.png").read_bytes().startswith(b"\x89PNG")
    assert report_html("graph", result.sections).count("data:image/png;base64,") == 1


def test_verdict_says_not_told_apart_within_the_spread():
    assert "not told apart" in graph.verdict({"gat": [0.9, 1.0, 0.8], "mean": [0.95, 0.85, 0.9]}, 20)
    assert "Graph attention classified more" in graph.verdict({"gat": [1.0, 0.99, 1.0], "mean": [0.5, 0.51, 0.5]}, 20)
