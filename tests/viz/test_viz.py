"""Static heat maps (PNG/SVG checked for size and content) and the HTML viewer's page, without a browser."""

from __future__ import annotations

import base64
import json
import re
import warnings

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from attnkit import viz
from attnkit.viz.heatmap import MASKED_COLOR

TOKENS = ["[CLS]", "the", "river", "bank", "was", "eroding", ".", "[SEP]"]
EVIL = "</script><img src=x onerror=alert(1)>"


def maps(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g), dim=-1)


def pixels(path):
    img = imread(path)[..., :3]  # float RGB in [0, 1]
    return (img * 255).round().astype(np.int16)


def assert_picture(path, min_w, min_h):
    img = pixels(path)
    h, w, _ = img.shape
    assert w >= min_w and h >= min_h, (w, h)
    assert path.stat().st_size > 5_000
    non_white = (img < 245).any(-1).mean()
    assert non_white > 0.05, f"{path.name} is nearly blank ({non_white:.1%} non-white)"
    assert img.std() > 20
    return img


def count_colour(img, rgb, tol=6):
    return int((np.abs(img - np.array(rgb)) <= tol).all(-1).sum())


MASKED_RGB = tuple(int(MASKED_COLOR[i:i + 2], 16) for i in (1, 3, 5))


def test_heatmap_png_has_labels_colours_and_masked_cells(tmp_path):
    w = maps(8, 8)
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[:, 6:] = False
    masked = assert_picture(viz.save(viz.heatmap(w, TOKENS, mask=mask, title="t"), tmp_path / "m.png"), 300, 300)
    plain = assert_picture(viz.save(viz.heatmap(w, TOKENS), tmp_path / "p.png"), 300, 300)
    # Masked cells are painted in their own colour (16 of 64 cells), absent without a mask.
    assert count_colour(masked, MASKED_RGB) > 1_000
    assert count_colour(plain, MASKED_RGB) == 0
    # The largest weight is drawn in the darkest blue of the colour map.
    assert count_colour(plain, (8, 48, 107), tol=12) > 50


def test_heatmap_reads_at_512_tokens_and_as_svg(tmp_path):
    n = 512
    tokens = [f"w{i}" for i in range(n)]
    img = assert_picture(viz.save(viz.heatmap(maps(n, n), tokens), tmp_path / "long.png"), 900, 900)
    assert img.shape[0] <= 1400  # capped size, labels thinned to every k-th token
    svg = viz.save(viz.heatmap(maps(5, 5), TOKENS[:5]), tmp_path / "small.svg")
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and "river" in text


def test_head_grid_and_head_stats(tmp_path):
    layer = maps(12, 8, 8)
    assert_picture(viz.save(viz.head_grid(layer, TOKENS, title="layer 0"), tmp_path / "grid.png"), 600, 400)
    four = viz.head_grid(layer, TOKENS, heads=[0, 3, 5, 11], labels=["a", "b", "c", "d"], ncols=4)
    assert [ax.get_title() for ax in four.axes[:4]] == ["a", "b", "c", "d"]
    att = [maps(1, 12, 8, 8, seed=s) for s in range(6)]
    for stat in ("entropy", "distance"):
        fig = viz.head_stats(att, stat)
        assert_picture(viz.save(fig, tmp_path / f"{stat}.png"), 400, 200)
        assert stat in fig.axes[0].get_title()


@pytest.mark.parametrize("call, match", [
    (lambda: viz.heatmap(maps(3, 3), ["a", "b"]), "q_tokens has 2 tokens"),
    (lambda: viz.heatmap(maps(3, 3), mask=torch.ones(2, 2, dtype=torch.bool)), "mask has shape"),
    (lambda: viz.heatmap(maps(2, 3, 3)), "weights must have 2 dimensions"),
    (lambda: viz.head_grid(maps(4, 3, 3), heads=[4]), r"heads must be in \[0, 4\)"),
    (lambda: viz.head_grid(maps(4, 3, 3), heads=[0], labels=["a", "b"]), "labels has 2"),
    (lambda: viz.head_stats([maps(1, 2, 3, 3)], "median"), "stat must be"),
    (lambda: viz.save(viz.heatmap(maps(3, 3)), "x.jpg"), r"must end in \.png or \.svg"),
])
def test_bad_arguments_name_what_is_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _data(page: str) -> dict:
    m = re.search(r'<script id="attnkit-data" type="application/json">(.*?)</script>', page, re.S)
    assert m, "data block missing"
    return json.loads(m.group(1))


def test_viewer_page_is_self_contained_and_escaped():
    att = [maps(1, 4, 9, 9, seed=s) for s in range(3)]
    page = viz.viewer_html(att, TOKENS + [EVIL], title="<b>bold</b> & co", text="The river bank")
    assert EVIL not in page and "<img" not in page
    assert page.count("<script") == 2 and page.count("</script>") == 2
    assert "<title>&lt;b&gt;bold&lt;/b&gt; &amp; co</title>" in page
    # Nothing is fetched: no URLs, imports, or external fonts; a CSP forbids it anyway.
    assert not re.search(r"https?:|//cdn|@import|url\(|@font-face|<link|src=\"", page.replace(EVIL, ""))
    assert "default-src 'none'" in page
    data = _data(page)
    assert data["tokens"][-1] == EVIL and data["mode"] == "dense"
    assert (data["layers"], data["heads"]) == (3, 4)
    stored = np.frombuffer(base64.b64decode(data["weights"]), np.uint8).reshape(3, 4, 9, 9)
    expected = np.rint(torch.stack([a[0] for a in att]).numpy() * 255)
    assert np.array_equal(stored, expected)


def test_viewer_keeps_top_k_per_query_for_long_inputs(tmp_path):
    n, k = 300, 8
    att = maps(2, 3, n, n, seed=1) ** 4  # peakier rows, like trained heads
    att = att / att.sum(-1, keepdim=True)
    path = viz.write_viewer(tmp_path / "v.html", att, [f"t{i}" for i in range(n)], max_dense_cells=10_000, top_k=k)
    data = _data(path.read_text())
    assert data["mode"] == "topk" and data["top_k"] == k and "strongest keys" in data["note"]
    idx = np.frombuffer(base64.b64decode(data["indices"]), "<u2").reshape(2, 3, n, k)
    vals = np.frombuffer(base64.b64decode(data["values"]), np.uint8).reshape(2, 3, n, k)
    top = torch.topk(att, k, dim=-1)
    assert np.array_equal(np.sort(idx, -1), np.sort(top.indices.numpy(), -1))
    assert np.array_equal(np.sort(vals, -1), np.sort(np.rint(top.values.numpy() * 255), -1))
    assert path.stat().st_size < 2 * 2 * 3 * n * k * 4 / 3 + 50_000  # ~3 bytes a kept entry, base64


@pytest.mark.parametrize("att, tokens, match", [
    ([], ["a"], "at least one layer"),
    ([maps(1, 2, 3, 3)], ["a", "b"], "tokens has 2 entries"),
    ([maps(1, 2, 3, 3), maps(1, 2, 4, 4)], ["a", "b", "c"], "expected"),
    ([maps(3, 3)], ["a", "b", "c"], r"\[B, H, L, L\]"),
])
def test_viewer_rejects_bad_input(att, tokens, match):
    with pytest.raises(ValueError, match=match):
        viz.viewer_html(att, tokens)


@pytest.mark.parametrize("title", ["__ATTNKIT_DATA__", "__ATTNKIT_TITLE__ and __ATTNKIT_DATA__"])
def test_viewer_title_holding_a_placeholder_name_keeps_the_page(title):
    # The title was substituted first, so its copy of the data placeholder received the data and
    # the real data block kept the bare placeholder: the page's JSON failed and it stayed blank.
    page = viz.viewer_html([maps(1, 2, 3, 3)], ["a", "b", "c"], title=title, text=title)
    data = _data(page)
    assert data["title"] == data["text"] == title and data["tokens"] == ["a", "b", "c"]
    assert f"<title>{title}</title>" in page


def test_viewer_lone_surrogates_become_replacement_characters(tmp_path):
    path = tmp_path / "v.html"
    tokens = ["ok", "\ud800", "\ud83d\ude00"]  # a lone half, and a pair that spells one emoji
    viz.write_viewer(path, [maps(1, 2, 3, 3)], tokens, title="t\udfff", text="x\ud800y")
    data = _data(path.read_bytes().decode("utf-8"))  # strict UTF-8: the file is valid
    assert data["tokens"] == ["ok", "\ufffd", "\U0001f600"]
    assert (data["title"], data["text"]) == ("t\ufffd", "x\ufffdy")


def test_write_viewer_failure_keeps_the_previous_page(tmp_path, monkeypatch):
    import os

    path = tmp_path / "v.html"
    viz.write_viewer(path, [maps(1, 2, 3, 3)], ["a", "b", "c"], title="first")
    before = path.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    # A disk that fills up while the page is written: the old page stays whole, no leftovers.
    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        viz.write_viewer(path, [maps(1, 2, 3, 3, seed=1)], ["a", "b", "c"], title="second")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.html"]


@pytest.mark.parametrize("bad, what", [(float("nan"), "nan"), (float("inf"), "inf")])
def test_viewer_refuses_non_finite_weights_naming_layer_and_head(bad, what):
    att = [maps(1, 2, 4, 4, seed=s) for s in range(3)]
    att[2][0, 1, 3, 0] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # before, NaN warned in the 8-bit cast and was drawn as 0, inf as 1
        with pytest.raises(ValueError, match=rf"attentions\[2\] \(layer 2\) has 1 non-finite weights, first at "
                                             rf"head 1, query 3, key 0 \({what}\)"):
            viz.viewer_html(att, ["a", "b", "c", "d"])


def test_viewer_title_must_be_text():
    with pytest.raises(TypeError, match="title must be a str, got int"):
        viz.viewer_html([maps(1, 2, 3, 3)], ["a", "b", "c"], title=3)
