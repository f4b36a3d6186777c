"""attnkit.apps._common: seeding, the training loop, checkpoints, pictures and tables."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from attnkit.apps import TASKS, _common, task
from tests.support.tolerances import close


def _regression(seed: int = 0):
    g = _common.seed_all(seed)
    model = nn.Linear(3, 1)
    x = torch.randn(64, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]])

    def batch_fn(step):
        idx = torch.randint(0, 64, (16,), generator=g)
        return x[idx], y[idx]

    def loss_fn(m, b):
        return ((m(b[0]) - b[1]) ** 2).mean()

    return model, batch_fn, loss_fn


def test_seed_all_seeds_every_generator_and_returns_a_seeded_one():
    g = _common.seed_all(5)
    first = (torch.rand(3), random.random(), np.random.rand(), torch.rand(3, generator=g))
    g = _common.seed_all(5)
    again = (torch.rand(3), random.random(), np.random.rand(), torch.rand(3, generator=g))
    assert torch.equal(first[0], again[0]) and first[1:3] == again[1:3] and torch.equal(first[3], again[3])
    assert not torch.equal(torch.rand(3, generator=_common.seed_all(6)), first[3])


def test_seed_all_rejects_a_non_int():
    with pytest.raises(TypeError, match="seed must be an int, got float"):
        _common.seed_all(1.0)


def test_fit_lowers_the_loss_and_leaves_the_model_in_eval_mode():
    model, batch_fn, loss_fn = _regression()
    losses = _common.fit(model, batch_fn, loss_fn, steps=150, lr=0.05, warmup=10, desc="t", progress=False)
    assert len(losses) == 150
    assert np.mean(losses[-10:]) < 0.01 * np.mean(losses[:10])
    assert not model.training


def test_fit_is_reproducible_to_the_last_digit():
    runs = []
    for _ in range(2):
        model, batch_fn, loss_fn = _regression(seed=3)
        runs.append((_common.fit(model, batch_fn, loss_fn, steps=20, lr=0.05, desc="t", progress=False),
                     model.weight.detach().clone()))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


def test_learning_rate_warms_up_linearly_then_decays_to_zero():
    f = [_common._lr_factor(s, 100, 10) for s in range(100)]
    close(torch.tensor(f[:10], dtype=torch.float64), torch.arange(1, 11, dtype=torch.float64) / 10)
    assert f[10] == 1.0 and all(a >= b for a, b in zip(f[10:], f[11:], strict=False))
    assert _common._lr_factor(100, 100, 10) == 0.0


def test_a_warmup_longer_than_the_run_is_cut_to_the_run():
    model, batch_fn, loss_fn = _regression()
    losses = _common.fit(model, batch_fn, loss_fn, steps=3, lr=0.05, warmup=50, desc="t", progress=False)
    assert len(losses) == 3


@pytest.mark.parametrize("kwargs, words", [
    ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ({"steps": 2.5}, "steps must be an integer >= 1, got 2.5"),
    ({"lr": 0.0}, "lr must be > 0, got 0.0"),
    ({"warmup": -1}, "warmup must be an integer >= 0, got -1"),
])
def test_fit_rejects_bad_arguments_by_name(kwargs, words):
    model, batch_fn, loss_fn = _regression()
    with pytest.raises(ValueError, match=words):
        _common.fit(model, batch_fn, loss_fn, desc="t", progress=False, **({"steps": 10, "lr": 0.1} | kwargs))


def test_save_and_load_give_the_same_model(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    _common.save(tmp_path, model, {"hidden": 8})
    assert json.loads((tmp_path / "config.json").read_text()) == {"hidden": 8}
    with open(tmp_path / "model.safetensors", "rb") as f:  # a safetensors header, not a pickle
        header_len = int.from_bytes(f.read(8), "little")
        assert json.loads(f.read(header_len))["0.weight"]["shape"] == [8, 4]
    back = _common.load(tmp_path, lambda c: nn.Sequential(nn.Linear(4, c["hidden"]), nn.ReLU(),
                                                          nn.Linear(c["hidden"], 2)))
    x = torch.randn(5, 4)
    assert not back.training and torch.equal(back(x), model(x))


def test_load_names_the_missing_file(tmp_path):
    _common.save(tmp_path, nn.Linear(2, 2), {})
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors: no such file"):
        _common.load(tmp_path, lambda c: nn.Linear(2, 2))


def test_load_names_the_weights_that_do_not_fit(tmp_path):
    _common.save(tmp_path, nn.Linear(2, 2), {})
    with pytest.raises(ValueError, match=r"model\.safetensors: weights do not fit the model built from config"):
        _common.load(tmp_path, lambda c: nn.Linear(2, 3))


def test_load_refuses_a_file_that_is_not_safetensors(tmp_path):
    _common.save(tmp_path, nn.Linear(2, 2), {})
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "model.safetensors")  # a pickle under that name
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        _common.load(tmp_path, lambda c: nn.Linear(2, 2))


def test_save_png_writes_a_png(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure()
    fig.add_subplot().plot([0, 1], [1, 0])
    path = _common.save_png(fig, tmp_path / "a.png")
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_table_aligns_columns_and_right_aligns_numbers():
    text = _common.table([{"model": "ViT", "acc": 0.97123, "n": 1437}, {"model": "CNN", "acc": 0.5, "n": 7}])
    lines = text.splitlines()
    assert lines[0].split() == ["model", "acc", "n"] and set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["ViT", "0.9712", "1,437"] and lines[3].split() == ["CNN", "0.5", "7"]
    assert len({len(line) for line in lines}) == 1  # every line as wide: the numbers end in one column


def test_task_names_the_known_tasks():
    with pytest.raises(ValueError, match="task must be one of vit, caption, .* got 'nosuch'"):
        task("nosuch")
    assert TASKS[0] == "vit" and task("vit").__name__ == "attnkit.apps.vit"


@pytest.mark.parametrize("accs, seconds, verdict", [
    ((0.97, 0.95, 0.97), (100.0, 120.0, 90.0), "yes"),   # the mean of the three seeds reaches 96%
    ((0.97, 0.94, 0.96), (100.0, 120.0, 90.0), "no"),    # one seed pulls the mean below
    ((0.97, 0.97, 0.97), (100.0, 200.0, 90.0), "no"),    # a run over three minutes
])
def test_bench_apps_judges_the_mean_of_seeds_and_the_time_and_lists_missing_tasks(
        monkeypatch, tmp_path, accs, seconds, verdict):
    from attnkit.apps import vit
    from attnkit.bench import apps as bench

    runs = iter(zip(accs, seconds, strict=True))

    def fake_run(*, out, seed, quick, progress):
        acc, secs = next(runs)
        return _common.Result("vit", {"vit_acc": acc, "cnn_acc": 0.99}, secs)

    monkeypatch.setattr(vit, "run", fake_run)
    monkeypatch.setattr(bench, "TASKS", ("vit", "nosuch"))
    monkeypatch.setitem(bench.TARGETS, "nosuch", ("anything", (0,), None))
    text = bench.run(False, tmp_path)
    assert (tmp_path / "apps.md").read_text() == text
    row = next(line for line in text.splitlines() if line.startswith("| vit |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"ViT {sum(accs) / 3:.1%}, CNN 99.0% (test accuracy, mean of 3 seeds)"
    assert cells[3] == verdict and cells[4] == " / ".join(f"{s:.0f}" for s in seconds)
    assert "| nosuch | not in this version |" in text
    assert ("took 200 s, above the 180 s target" in text) == (max(seconds) > 180)


def test_evaluation_rows_show_each_metric_under_its_label_and_the_keys_stay():
    result = _common.Result("vit", {"vit_acc": 0.5, "final_loss": 1.25, "data set": "digits"}, 2.04,
                            labels={"vit_acc": "ViT test accuracy"})
    assert result.evaluation_rows() == [{"Metric": "ViT test accuracy", "Value": 0.5},
                                        {"Metric": "Final loss", "Value": 1.25},
                                        {"Metric": "Data set", "Value": "digits"},
                                        {"Metric": "Seconds in all", "Value": 2.0}]
    assert result.metrics["vit_acc"] == 0.5
