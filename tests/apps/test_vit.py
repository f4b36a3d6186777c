"""attnkit.apps.vit at the QUICK size: the data split, the models, training, checkpoints, pictures, report."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnkit.apps import vit
from attnkit.modules import MultiHeadAttention
from tests.support.apps_checks import report_embeds_pictures
from tests.support.tolerances import close
from tests.viz.test_report import app_report_problems

PICTURES = ("vit_data_efficiency.png", "vit_rollout.png", "vit_losses.png")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vit")
    return out, vit.run(out=out, quick=True, progress=False)


@pytest.fixture(scope="module")
def split():
    return vit.digits()


def _tiny(kind="vit"):
    torch.manual_seed(0)
    return vit.build({**vit.DEFAULTS, **vit.QUICK, "model": kind}).eval()


def test_split_is_fixed_stratified_and_disjoint(split):
    x_tr, y_tr, x_te, y_te = split
    assert (len(y_tr), len(y_te)) == (1437, 360)
    assert torch.equal(vit.digits()[3], y_te)  # the same test images whatever the run's seed
    assert 0.0 <= x_tr.min() and x_tr.max() <= 1.0
    assert torch.bincount(y_te).min() >= 35  # every class in the test split, about a tenth each
    train = {tuple(x.flatten().tolist()) for x in x_tr}
    assert sum(tuple(x.flatten().tolist()) in train for x in x_te) <= 3  # the set holds a few duplicates


@pytest.mark.parametrize("fraction", [0.1, 0.3, 1.0])
def test_subset_keeps_the_share_of_every_class(split, fraction):
    _, y_tr, _, _ = split
    idx = vit.subset(y_tr, fraction, torch.Generator().manual_seed(0))
    assert len(set(idx.tolist())) == len(idx)
    per_class, full = torch.bincount(y_tr[idx], minlength=10), torch.bincount(y_tr, minlength=10)
    assert ((per_class - fraction * full).abs() <= 0.5).all()


def test_patches_are_2x2_blocks_in_reading_order():
    model = _tiny()
    with torch.no_grad():
        model.embed.weight.zero_()
        model.embed.weight[0, :] = torch.tensor([1.0, 10.0, 100.0, 1000.0])  # feature 0 spells the patch
        model.embed.bias.zero_()
        model.pos.zero_()
    img = torch.arange(64, dtype=torch.float32).reshape(1, 8, 8)
    tokens = model.tokens(img)[0, 1:, 0]  # (16,) skipping the class token
    for k in range(16):
        r, c = 2 * (k // 4), 2 * (k % 4)
        block = img[0, r:r + 2, c:c + 2].flatten()
        close(tokens[k], block @ torch.tensor([1.0, 10.0, 100.0, 1000.0]))


def test_attention_modules_are_the_librarys_own():
    model = _tiny()
    attn = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert len(attn) == vit.QUICK["num_layers"]
    assert all(isinstance(layer.self_attn, MultiHeadAttention) for layer in model.layers)
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())


def test_attention_maps_are_the_weights_the_forward_pass_uses():
    model = _tiny()
    x = torch.rand(3, 8, 8)
    seen = []

    def record(m, args, kwargs, out):  # the weights of the input each attention gets in the real forward
        if not kwargs.get("need_weights"):
            seen.append(m(args[0], need_weights=True)[1])

    hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in model.layers]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    maps = model.attention_maps(x)
    assert len(maps) == len(seen) == vit.QUICK["num_layers"]
    for got, used in zip(maps, seen, strict=True):
        assert got.shape == (3, vit.QUICK["num_heads"], 17, 17)
        close(got, used)


def test_models_have_about_the_same_size():
    a, b = (vit.n_params(vit.build({**vit.DEFAULTS, "model": k})) for k in ("vit", "cnn"))
    assert abs(a - b) / max(a, b) < 0.1


@pytest.mark.slow  # shares one quick run of six trainings: 10-15 s on this 2-core machine
def test_training_lowers_the_loss_and_beats_chance(quick_run):
    _, result = quick_run
    m = result.metrics
    assert m["last_loss"] < 0.95 * m["first_loss"]
    for key in ("vit_acc", "cnn_acc", "vit_acc_10%", "cnn_acc_30%"):
        assert m[key] > 0.2, (key, m[key])  # chance is 0.1


@pytest.mark.slow  # shares one quick run of six trainings: 10-15 s on this 2-core machine
def test_checkpoint_is_the_trained_vit(quick_run, split):
    out, result = quick_run
    model = vit.load(out)
    assert isinstance(model, vit.ViT) and not model.training
    _, _, x_te, y_te = split
    assert vit.accuracy(model, x_te, y_te) == result.metrics["vit_acc"]
    assert torch.equal(vit.load(out)(x_te[:5]), model(x_te[:5]))


def test_same_seed_trains_the_same_weights():
    cfg = {**vit.DEFAULTS, **vit.QUICK, "steps": 5}
    x, y, _, _ = vit.digits()
    a, la = vit.train("vit", cfg, x[:100], y[:100], seed=3, progress=False, desc="")
    b, lb = vit.train("vit", cfg, x[:100], y[:100], seed=3, progress=False, desc="")
    assert la == lb and all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.slow  # shares one quick run of six trainings: 10-15 s on this 2-core machine
def test_pictures_are_written_and_the_report_holds_them(quick_run):
    out, result = quick_run
    assert sorted(report_embeds_pictures(result, out)) == sorted(PICTURES)
    for name in PICTURES:
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5_000


def test_the_report_shows_labels_and_tables_for_people(quick_run):
    _, result = quick_run
    assert app_report_problems(result) == []
    rows = {row["Metric"]: row["Value"] for row in result.evaluation_rows()}
    assert rows["ViT test accuracy"] == result.metrics["vit_acc"]  # the key stays for code, people see the label
    assert rows["CNN test accuracy, 10% of the training images"] == result.metrics["cnn_acc_10%"]


# ------------------------------------------------------------------ the data-size trend, measured


@pytest.mark.parametrize("leads, words", [
    ({1.0: [1.0, 2.0], 0.3: [4.0, 5.0], 0.1: [9.0, 6.0]}, "grows as the training data shrinks, in every run:"),
    ({1.0: [1.0, 2.0], 0.3: [4.0, 1.0], 0.1: [9.0, 6.0]}, "grows as the training data shrinks on average, but not"),
    ({1.0: [1.0], 0.3: [4.0], 0.1: [3.0]}, "does not grow steadily as the training data shrinks:"),
    ({1.0: [3.0], 0.3: [2.0], 0.1: [1.0]}, "does not grow steadily as the training data shrinks:"),
])
def test_the_trend_says_what_the_leads_show(leads, words):
    text = vit.trend(leads)
    assert words in text and f"{sum(leads[0.1]) / len(leads[0.1]):+.1f} points at 10%" in text
    with pytest.raises(ValueError, match="same number of runs"):
        vit.trend({1.0: [1.0], 0.1: [1.0, 2.0]})


def test_a_run_states_its_own_trend(quick_run):
    _, result = quick_run
    section = next(s for s in result.sections if s.title.startswith("ViT against a CNN"))
    assert "gap grows" not in section.text
    assert vit.trend(vit.leads(section.table)) in section.text


def test_the_guide_states_the_trend_the_table_measured():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    table = (root / "bench/results/apps.md").read_text(encoding="utf-8")
    section = table.split("## ViT against a CNN by share of the training images", 1)[1]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ") and "%" in line]
    leads = {float(r[0].strip().rstrip("%")) / 100: float(r[3].split("(")[0]) for r in rows}
    assert sorted(leads) == [0.1, 0.3, 1.0]
    # The table's sentence comes from vit.trend; its mean leads must agree with it.
    grows = leads[0.1] > leads[0.3] > leads[1.0]
    said = next(line for line in section.splitlines() if line.startswith("The CNN's lead"))
    assert ("grows as the training data shrinks" in said) == grows
    guide = (root / "docs/guides/applications.md").read_text(encoding="utf-8")
    phrase = said.split(":")[0].removeprefix("The CNN's lead over the ViT ")
    assert f"the CNN's lead over the ViT {phrase}" in " ".join(guide.split())
    for stale in ("gap grows", "trails most when"):
        assert stale not in guide and stale not in (root / "attnkit/apps/vit.py").read_text(encoding="utf-8")
