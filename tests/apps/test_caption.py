"""attnkit.apps.caption at the QUICK size: strips, patches, the attention-placement measure, training, checkpoints."""

from __future__ import annotations

import pytest
import torch

from attnkit.apps import _common
from attnkit.apps import caption as cap
from attnkit.apps.translate import EOS, PAD
from attnkit.modules import MultiHeadAttention
from tests.support.apps_checks import report_embeds_pictures, same_seed_same_checkpoint
from tests.viz.test_report import app_report_problems


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("caption")
    return out, cap.run(out=out, quick=True, progress=False)


@pytest.fixture(scope="module")
def digits():
    return cap.load_digits_split(torch.Generator().manual_seed(0))


def _tiny_model():
    torch.manual_seed(0)
    return cap.build({**cap.DEFAULTS, **cap.QUICK}).eval()


def test_train_and_test_images_are_disjoint(digits):
    (train_x, _), (test_x, _) = digits
    assert len(train_x) + len(test_x) == 1797
    train = {tuple(x.flatten().tolist()) for x in train_x}
    # The data set holds a few identical images; every test image not among them is new.
    assert sum(tuple(x.flatten().tolist()) in train for x in test_x) <= 5


def test_strips_place_each_digit_in_its_own_columns(digits):
    (x, y), _ = digits
    g = torch.Generator().manual_seed(1)
    strips, mask, tgt, counts = cap.make_strips(x, y, 50, g)
    assert strips.shape == (50, 8, 8 * cap.MAX_DIGITS)
    assert set(counts.tolist()) == {3, 4, 5}
    for s, m, t, n in zip(strips, mask, tgt, counts.tolist(), strict=True):
        labels = [int(cap.TGT_VOCAB[i]) for i in t[:n].tolist()]
        assert t[n] == EOS and (t[n + 1:] == PAD).all()
        for k, label in enumerate(labels):
            block = s[:, 8 * k:8 * (k + 1)]
            # The block is one of the images of that label.
            assert (x[y == label] == block).all(-1).all(-1).any()
        assert (s[:, 8 * n:] == 0).all()
        assert m.tolist() == [True] * (n * cap.PATCHES_PER_DIGIT) + [False] * ((5 - n) * cap.PATCHES_PER_DIGIT)


def test_jitter_moves_each_digit_by_at_most_one_pixel(digits):
    (x, _), _ = digits
    moved = cap.jitter(x[:200], torch.Generator().manual_seed(3))
    padded = torch.nn.functional.pad(x[:200], (1, 1, 1, 1))
    shifts = torch.stack([padded[:, dy:dy + 8, dx:dx + 8] for dy in range(3) for dx in range(3)], dim=1)
    which = (shifts == moved[:, None]).all(-1).all(-1)  # (N, 9): the shifts each result equals
    assert which.any(dim=1).all()
    assert which[:, 4].float().mean() < 0.5  # most are moved (4 = no shift; 1 in 9 expected)


def test_patches_are_column_slices_left_to_right():
    strips = torch.arange(2 * 8 * 40, dtype=torch.float32).reshape(2, 8, 40)
    p = cap.patches(strips)
    assert p.shape == (2, cap.NUM_PATCHES, 8 * cap.PATCH_W)
    for i in range(cap.NUM_PATCHES):
        assert torch.equal(p[:, i], strips[:, :, cap.PATCH_W * i:cap.PATCH_W * (i + 1)].flatten(1))


def test_attention_on_digit_counts_only_generated_words_on_their_digit(monkeypatch):
    """The placement measure, on a decoder whose predictions and attention are set by hand."""
    n_patch = cap.NUM_PATCHES
    pred = torch.tensor([[4, 5, 6, EOS, PAD, PAD], [4, 5, 6, 7, EOS, PAD]])
    attn = torch.zeros(2, cap.TGT_LEN, n_patch)
    ppd = cap.PATCHES_PER_DIGIT
    attn[0, 0, 0 * ppd + 1] = 1  # word 1 -> digit 1: hit
    attn[0, 1, 2 * ppd] = 1  # word 2 -> digit 3: miss
    attn[0, 2, 2 * ppd + 3] = 1  # word 3 -> digit 3: hit
    attn[0, 3, 0] = 1  # <eos>: not a word, not counted
    for t in range(4):  # second row: all four words on their digit
        attn[1, t, t * ppd] = 1

    class Recorded:
        def __init__(self, model):
            self.records = [[attn[:, :, None, :].transpose(1, 2).expand(2, 1, cap.TGT_LEN, n_patch)]]

        def __enter__(self):
            return self.records

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cap, "recording_cross_attention", Recorded)
    monkeypatch.setattr(cap, "greedy", lambda model, strips, mask: pred)
    tgt = pred.clone()
    metrics, _, _ = cap.evaluate(None, None, None, tgt, torch.tensor([3, 4]))
    assert metrics["attention_on_digit"] == 6 / 7
    assert metrics["exact_caption"] == 1.0


def test_attention_modules_are_the_librarys():
    model = _tiny_model()
    enc, dec = model.transformer.encoder.layers, model.transformer.decoder.layers
    expected = [lay.self_attn for lay in enc] + [m for lay in dec for m in (lay.self_attn, lay.cross_attn)]
    assert all(isinstance(m, MultiHeadAttention) for m in expected)
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())


def test_checkpoint_reloads_to_identical_outputs(tmp_path, digits):
    (x, y), _ = digits
    torch.manual_seed(0)
    cfg = {**cap.DEFAULTS, **cap.QUICK}
    model = cap.build(cfg)
    strips, mask, tgt, counts = cap.make_strips(x, y, 8, torch.Generator().manual_seed(2))
    _common.fit(model, lambda step: (strips, mask, tgt), cap.loss_fn, steps=3, lr=1e-2, desc="c", progress=False)
    _common.save(tmp_path, model, cfg)
    again = cap.load(tmp_path)
    assert not again.training
    assert torch.equal(again(strips, tgt, mask), model(strips, tgt, mask))
    assert torch.equal(cap.greedy(again, strips, mask), cap.greedy(model, strips, mask))


@pytest.mark.slow  # seconds on a quiet CPU; a minute or more when 2 threads share a loaded one
def test_quick_run_learns_and_reports(quick_run):
    out, result = quick_run
    m = result.metrics
    assert result.task == "caption"
    assert m["final_loss"] < 0.7 * m["first_loss"]
    assert m["digit_accuracy"] > 0.3  # chance: 0.1
    assert cap.load(out).transformer.decoder.layers[0].cross_attn.embed_dim == cap.QUICK["embed_dim"]
    assert report_embeds_pictures(result, out) == ["caption_attention.png"]


def test_same_seed_same_checkpoint(tmp_path):
    same_seed_same_checkpoint(cap, tmp_path)


def test_the_report_shows_labels_for_people(quick_run):
    _, result = quick_run
    assert app_report_problems(result) == []
    rows = {row["Metric"]: row["Value"] for row in result.evaluation_rows()}
    assert rows["Exact caption (share of test strips)"] == result.metrics["exact_caption"]
