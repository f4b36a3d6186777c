"""attnkit.apps.recommend at its QUICK size: the generated sessions have the structure the
docstring claims, the baselines count right, SASRec learns and is causal, the checkpoint and
picture round-trip, and the attention is the library's own."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from attnkit.apps import recommend
from attnkit.modules import MultiHeadAttention
from attnkit.viz.report import report_html
from tests.support.tolerances import MODEL_PARITY, close
from tests.viz.test_report import app_report_problems

Q = {**recommend.DEFAULTS, **recommend.QUICK}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("recommend")
    return recommend.run(out=out, quick=True, progress=False), out


@pytest.fixture(scope="module")
def world():
    gen = torch.Generator().manual_seed(0)
    paths, theme_p, item_p = recommend.make_world(Q["num_items"], Q["num_themes"], Q["path_len"], gen)
    return paths, theme_p, item_p, recommend.make_sessions(300, paths, theme_p, item_p, Q["max_len"], gen)


def test_sessions_follow_a_theme_path_with_skips_and_detours(world):
    paths, theme_p, item_p, sessions = world
    close(theme_p.sum(), torch.tensor(1.0))
    assert item_p[recommend.PAD] == 0
    n = recommend.lengths_of(sessions)
    assert n.min() >= 6 and n.max() <= Q["max_len"]
    assert ((sessions != recommend.PAD).long().diff(dim=1) <= 0).all()  # right-padded
    steps = {(int(p[i]), int(p[(i + d) % len(p)])) for p in paths for i in range(len(p)) for d in (1, 2)}
    pairs = [(int(s[t]), int(s[t + 1])) for s, k in zip(sessions, n, strict=True) for t in range(int(k) - 1)]
    on_path = sum(pair in steps for pair in pairs) / len(pairs)
    # 90% of moves are path steps; a detour and the step back are off the path (about 20%).
    assert 0.7 < on_path < 0.95


def test_baselines_count_the_training_sessions():
    train = torch.tensor([[1, 2, 3, 0], [1, 2, 4, 0], [5, 2, 3, 1], [3, 3, 3, 3]])
    assert recommend.popular_top_k(train, 2, k=2).tolist() == [[3, 1], [3, 1]]
    prefix = torch.tensor([[2, 0, 0, 0], [9, 5, 0, 0]])
    # After 2: 3 twice, 4 once. After 5: 2 once, then the most popular items break the tie.
    assert recommend.transition_top_k(train, prefix, num_items=9, k=2).tolist() == [[3, 4], [2, 3]]
    assert recommend.hit_rate(torch.tensor([[3, 4], [2, 3]]), torch.tensor([4, 1])) == 0.5
    held_in, last = recommend.split_last(torch.tensor([[4, 5, 6, 0], [7, 8, 0, 0]]))
    assert held_in.tolist() == [[4, 5, 0, 0], [7, 0, 0, 0]] and last.tolist() == [6, 8]


def test_loss_falls_and_hit_rate_beats_chance_and_popularity(trained):
    m = trained[0].metrics
    assert m["last loss (mean of 50)"] < 0.8 * m["first loss"]
    sasrec = m["HR@10 SASRec (causal self-attention)"]
    assert sasrec > 2 * m["chance HR@10"]
    assert sasrec > m["HR@10 most popular"]


def test_a_later_item_never_changes_an_earlier_prediction(trained):
    model = recommend.load(trained[1])
    sessions = torch.randint(1, Q["num_items"] + 1, (3, Q["max_len"]), generator=torch.Generator().manual_seed(1))
    changed = sessions.clone()
    changed[:, 7:] = torch.randint(1, Q["num_items"] + 1, changed[:, 7:].shape)
    with torch.no_grad():
        assert torch.equal(model(sessions)[:, :7], model(changed)[:, :7])
        assert not torch.equal(model(sessions)[:, 7:], model(changed)[:, 7:])


def test_the_checkpoint_reloads_to_the_same_weights_and_hit_rate(trained):
    result, out = trained
    model = recommend.load(out)
    stored = load_file(out / "model.safetensors")
    assert stored.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, stored[name]), name
    gen = torch.Generator().manual_seed(recommend.DATA_SEED)
    paths, theme_p, item_p = recommend.make_world(Q["num_items"], Q["num_themes"], Q["path_len"], gen)
    sessions = recommend.make_sessions(Q["train_sessions"] + Q["test_sessions"], paths, theme_p, item_p,
                                       Q["max_len"], gen)
    prefix, target = recommend.split_last(sessions[Q["train_sessions"]:])
    hr = recommend.hit_rate(recommend.model_top_k(model, prefix), target)
    assert hr == result.metrics["HR@10 SASRec (causal self-attention)"]


def test_recorded_attention_is_causal_and_leaves_the_output_alone(trained):
    model = recommend.load(trained[1])
    session = torch.arange(1, 9)[None]
    with torch.no_grad():
        plain = model(session)
        with recommend.recorded_attention(model) as maps:
            hooked = model(session)
        after = model(session)
    # Weights come from the reference backend, the plain pass may take a fused one: rounding differs.
    close(hooked, plain, **MODEL_PARITY[torch.float32])
    assert torch.equal(plain, after)  # the hooks are gone
    assert len(maps) == Q["num_layers"]
    w = maps[0]  # (B, H, L, L)
    assert w.shape == (1, Q["num_heads"], 8, 8)
    close(w.sum(-1), torch.ones(w.shape[:-1]))
    assert (w.triu(1) == 0).all()


def test_the_attention_is_the_library_own(trained):
    model = recommend.load(trained[1])
    attention = [m for m in model.modules() if isinstance(m, MultiHeadAttention | torch.nn.MultiheadAttention)]
    assert len(attention) == len(model.encoder.layers) >= 1
    assert all(isinstance(m, MultiHeadAttention) for m in attention)


def test_the_picture_is_written_and_the_report_holds_it(trained):
    result, out = trained
    images = [img for section in result.sections for img in section.images]
    assert [p.name for p in images] == ["recommend_attention.png"]
    assert (out / "recommend_attention.png").read_bytes().startswith(b"\x89PNG")
    assert report_html("recommend", result.sections).count("data:image/png;base64,") == len(images)


def test_one_seed_gives_the_same_checkpoint_to_the_last_bit(trained, tmp_path):
    recommend.run(out=tmp_path, quick=True, progress=False)
    assert (tmp_path / "model.safetensors").read_bytes() == (trained[1] / "model.safetensors").read_bytes()
    other = tmp_path / "seed1"
    recommend.run(out=other, quick=True, seed=1, progress=False)
    assert (other / "model.safetensors").read_bytes() != (trained[1] / "model.safetensors").read_bytes()


def test_the_report_shows_labels_for_people(trained):
    result, _ = trained
    assert app_report_problems(result) == []
    rows = {row["Metric"]: row["Value"] for row in result.evaluation_rows()}
    assert rows["Hit rate@10 by chance"] == result.metrics["chance HR@10"]
