"""attnkit.apps.lm at its QUICK size, and its parts on hand-made inputs: the docstring corpus is
deterministic, the n-gram baselines give the hand-computed perplexity, the head detectors score
hand-built patterns, the evaluator scores every character once, cached generation matches a full
forward, and the checkpoint reloads to the same numbers."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from safetensors.torch import load_file

from attnkit.apps import _corpus, _ngram, lm
from tests.support.apps_checks import _png_signature, report_embeds_pictures, same_seed_same_checkpoint
from tests.support.tolerances import MODEL_PARITY, close
from tests.viz.test_report import app_report_problems

Q = {**lm.DEFAULTS, **lm.QUICK}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    return lm.run(out=out, quick=True, progress=False), out


@pytest.fixture(scope="module")
def small_gpt():
    torch.manual_seed(0)
    return lm.GPT(vocab_size=11, block_size=16, embed_dim=16, num_heads=2, num_layers=2, ffn_dim=32,
                  dropout=0.0).eval()


# --------------------------------------------------------------------------- corpus

def test_the_corpus_is_the_same_text_whatever_this_process_imported():
    docs = _corpus.documents()
    assert _corpus.MODULES == tuple(sorted(_corpus.MODULES))
    assert len(docs) > 2000 and sum(map(len, docs)) > 500_000
    # Each call is a fresh interpreter with its own random string-hash seed: no set order leaks in.
    assert _corpus.documents() == docs
    # Read here instead, after torch has replaced inspect.getfile, the text would differ.
    import inspect

    assert getattr(inspect.getfile, "__module__", None) != "inspect"
    assert "inspect.getfile(object)" in "\n".join(d.split("\n", 1)[0] for d in docs)
    assert _corpus.read(["inspect"]) != _corpus.documents(["inspect"])
    with pytest.raises(ValueError, match="No module named 'nosuch'"):
        _corpus.documents(["json", "nosuch"])


def test_documents_are_named_and_read_once():
    docs = _corpus.documents(("json", "json.decoder", "textwrap"))
    heads = [d.split("\n", 1)[0] for d in docs]
    assert heads[0] == "json" and any(h.startswith("json.dumps(obj, *, skipkeys=False") for h in heads)
    assert any(h.startswith("textwrap.TextWrapper.wrap(self, text)") for h in heads)
    assert len({d.split("\n", 1)[1] for d in docs}) == len(docs)  # no docstring twice
    assert not any(" at 0x" in d for d in docs)


def test_split_holds_out_every_tenth_whole_document():
    docs = [f"doc {i}\nline" for i in range(25)]
    train, val = _corpus.split(docs)
    assert val == "doc 9\nline\n\ndoc 19\nline"
    assert train.split("\n\n") == [d for i, d in enumerate(docs) if i not in (9, 19)]
    with pytest.raises(ValueError, match="every must be an integer >= 2, got 1"):
        _corpus.split(docs, every=1)


def test_char_vocab_keeps_frequent_characters_and_maps_the_rest_to_unknown():
    vocab = lm.CharVocab.from_text("aaabbc\n", min_count=2)
    assert vocab.chars == "ab" and len(vocab) == 3
    assert vocab.encode("abcz").tolist() == [1, 2, 0, 0]
    assert vocab.decode([1, 2, 0]) == "ab\ufffd"
    assert vocab.decode(vocab.encode("baba")) == "baba"


# --------------------------------------------------------------------------- n-gram baselines

def test_bigram_perplexity_is_the_hand_computed_one():
    # V = 3, alpha = 1, train 0 1 0 1 1. Unigram: (N(c) + 1/3) / (5 + 1) = 7/18, 10/18, 1/18.
    # Bigram (N(b c) + P1(c)) / (N(b) + 1): after 1 (N = 2): P(0) = (1 + 7/18) / 3 = 25/54,
    # P(2) = (0 + 1/18) / 3 = 1/54; after 0 (N = 2): P(1) = (2 + 10/18) / 3 = 23/27.
    model = _ngram.NGram(np.array([0, 1, 0, 1, 1]), 3, order=2, alpha=1.0)
    close(torch.from_numpy(model.probs[0]).double(), torch.tensor([7, 10, 1], dtype=torch.float64) / 18)
    val = np.array([1, 0, 1, 2])  # predicts 0 | 1, 1 | 0, 2 | 1
    expected = -(math.log(25 / 54) + math.log(23 / 27) + math.log(1 / 54)) / 3
    assert model.cross_entropy(val) == pytest.approx(expected, rel=1e-12)
    assert _ngram.perplexity(model.cross_entropy(val)) == pytest.approx((54 / 25 * 27 / 23 * 54) ** (1 / 3), rel=1e-12)


def test_trigram_backs_off_to_the_bigram_and_starts_with_a_shorter_context():
    model = _ngram.NGram(np.array([0, 1, 0, 1, 1]), 3, order=3, alpha=1.0)
    # t = 1 has one id before it: the bigram's 23/27. t = 2: N(0 1 1) = 1, N(0 1) = 2, and the
    # bigram P(1 | 1) = (1 + 10/18) / 3 = 14/27, so (1 + 14/27) / (2 + 1) = 41/81.
    got = model.log_probs(np.array([0, 1, 1]))
    close(torch.from_numpy(got), torch.tensor([math.log(23 / 27), math.log(41 / 81)], dtype=torch.float64))
    for p in model.probs:
        np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-12)


def test_fit_chooses_alpha_on_the_training_ids_only():
    rng = np.random.default_rng(0)
    train = rng.integers(0, 5, 400)
    model = _ngram.fit(train, 5, order=2)
    cut = int(len(train) * 0.9)
    best = min(_ngram.ALPHAS, key=lambda a: _ngram.NGram(train[:cut], 5, order=2, alpha=a).cross_entropy(train[cut:]))
    assert model.alpha == best
    np.testing.assert_array_equal(model.probs[1], _ngram.NGram(train, 5, order=2, alpha=best).probs[1])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\)"):
        _ngram.fit(np.array([0, 7, 1]), 5, order=2)


# --------------------------------------------------------------------------- head detectors

def test_a_pure_previous_token_pattern_scores_one():
    n = 6
    prev = torch.zeros(n, n)
    prev[0, 0] = 1
    prev[torch.arange(1, n), torch.arange(n - 1)] = 1
    assert lm.previous_token_score(prev) == 1
    assert lm.previous_token_score(torch.eye(n)) == 0
    close(lm.previous_token_score(lm.uniform_causal(4)), torch.tensor((1 / 2 + 1 / 3 + 1 / 4) / 3))
    assert lm.previous_token_score(torch.stack([prev, torch.eye(n)])).tolist() == [1.0, 0.0]


def test_a_pure_induction_pattern_scores_one_and_a_previous_token_head_does_not():
    period, n = 4, 10
    ind = lm.uniform_causal(n).clone()
    for i in range(period, n):  # i attends to the token after the earlier copy of x[i]
        ind[i] = 0
        ind[i, i - period + 1] = 1
    assert lm.induction_score(ind, period) == 1
    prev = torch.zeros(n, n)
    prev[0, 0] = 1
    prev[torch.arange(1, n), torch.arange(n - 1)] = 1
    assert lm.induction_score(prev, period) == 0
    with pytest.raises(ValueError, match=r"period must be an int in \[1, 10\), got 10"):
        lm.induction_score(ind, 10)
    with pytest.raises(ValueError, match=r"attn must be \[..., L, L\]"):
        lm.previous_token_score(torch.zeros(3, 4))


def test_the_verdict_says_what_formed_against_the_threshold_and_uniform_attention():
    assert lm._said("previous-token", 0.9, 0.035, (0, 1)) == (
        "A previous-token head formed: layer 1 head 1 scores 0.9, 26 times uniform attention's 0.035.")
    assert lm._said("induction", 0.004, 0.011, (2, 3), "on the random characters") == (
        "No induction head formed on the random characters: the best, layer 3 head 3, scores 0.004, below 0.4 "
        "(below uniform attention's 0.011).")
    assert lm._copied("held-out text", 2.0, 0.5).endswith("the model copies from earlier in its context.")
    assert lm._copied("held-out text", 2.0, 1.9).endswith("no sign of copying from earlier in the context.")


def test_repeated_random_sequences_repeat_known_characters():
    seq = lm.repeated_random(3, 7, 11, torch.Generator().manual_seed(0))
    assert seq.shape == (3, 14) and torch.equal(seq[:, :7], seq[:, 7:])
    assert seq.min() >= 1 and seq.max() < 11  # never the unknown id 0


# --------------------------------------------------------------------------- model and evaluation

def test_head_scores_cover_every_layer_and_head(small_gpt):
    val = torch.randint(1, 11, (200,), generator=torch.Generator().manual_seed(6))
    scores = lm.head_scores(small_gpt, val, torch.Generator().manual_seed(7), batch=3)
    for key in ("previous", "induction", "induction_text"):
        assert scores[key].shape == (2, 2) and ((scores[key] >= 0) & (scores[key] <= 1)).all(), key
    assert scores["copy_loss"].shape == (2, 2) and (scores["copy_loss"] > 0).all()


def test_the_evaluator_scores_every_character_once(small_gpt):
    ids = torch.randint(11, (50,), generator=torch.Generator().manual_seed(2))
    # One window: the plain formula.
    short = ids[:17]
    expected = F.cross_entropy(small_gpt(short[None, :-1])[0], short[1:]).item()
    assert lm.cross_entropy(small_gpt, short) == pytest.approx(expected, rel=1e-5)

    class Unigram(torch.nn.Module):  # each prediction from its own input id only: windows do not matter
        block_size = 16

        def forward(self, x):
            return torch.log_softmax(torch.arange(11.0)[None, None] * (x[..., None] + 1) / 10, -1)

    whole = F.cross_entropy(Unigram()(ids[None, :-1])[0], ids[1:]).item()
    assert lm.cross_entropy(Unigram(), ids) == pytest.approx(whole, rel=1e-6)


def test_a_later_character_never_changes_an_earlier_prediction(small_gpt):
    x = torch.randint(11, (2, 16), generator=torch.Generator().manual_seed(3))
    y = x.clone()
    y[:, 9:] = (y[:, 9:] + 1) % 11
    with torch.no_grad():
        assert torch.equal(small_gpt(x)[:, :9], small_gpt(y)[:, :9])
        assert not torch.equal(small_gpt(x)[:, 9:], small_gpt(y)[:, 9:])
    with pytest.raises(ValueError, match="run past block_size 16"):
        small_gpt(torch.zeros(1, 17, dtype=torch.long))


def test_decoding_through_the_cache_matches_the_full_forward(small_gpt):
    x = torch.randint(11, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = small_gpt(x)
        caches = small_gpt.make_caches(1)
        steps = [small_gpt(x[:, :5], caches)] + [small_gpt(x[:, t: t + 1], caches) for t in range(5, 16)]
    close(torch.cat(steps, dim=1), full, **MODEL_PARITY[torch.float32])
    out = lm.generate(small_gpt, x[0, :3], 40, generator=torch.Generator().manual_seed(5))
    assert out.shape == (40,) and out.min() >= 0 and out.max() < 11  # past block_size: goes on from half a block
    again = lm.generate(small_gpt, x[0, :3], 40, generator=torch.Generator().manual_seed(5))
    assert torch.equal(out, again)


# --------------------------------------------------------------------------- the quick run

def test_the_quick_run_learns_and_reports_the_baselines(trained):
    m = trained[0].metrics
    assert m["final_loss"] < 0.85 * m["first_loss"]
    for name in ("GPT", "bigram", "trigram"):
        assert m[f"validation perplexity per char, {name}"] == pytest.approx(
            math.exp(m[f"validation nats per char, {name}"]))
    # The smoothed n-grams do better than a uniform guess over the vocabulary.
    assert m["validation perplexity per char, trigram"] < m["validation perplexity per char, bigram"] \
        < m["vocabulary (characters)"]
    for key in ("previous-token score", "induction score", "induction score, held-out text repeated"):
        assert 0 <= m[key] <= 1, key


def test_the_checkpoint_reloads_to_the_same_numbers_bit_for_bit(trained):
    result, out = trained
    model = lm.load(out)
    stored = load_file(out / "model.safetensors")
    assert stored.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, stored[name]), name
    vocab = lm.load_vocab(out)
    data = lm.corpus(Q["modules"], min_char_count=Q["min_char_count"])
    assert vocab.chars == data.vocab.chars and len(vocab) == model.tok.num_embeddings
    assert lm.cross_entropy(model, torch.from_numpy(data.val)) == result.metrics["validation nats per char, GPT"]
    snippet = torch.from_numpy(data.val[None, :40])
    with torch.no_grad():
        assert torch.equal(model(snippet), lm.load(out)(snippet))


def test_the_report_holds_the_pictures_and_samples(trained):
    result, out = trained
    assert sorted(report_embeds_pictures(result, out)) == sorted(
        ["lm_loss.png", "lm_head_scores.png", "lm_previous_token_head.png", "lm_induction_head.png"])
    samples = next(s for s in result.sections if s.title == "Samples").table
    assert len(samples) == Q["samples"] and all(len(row["Sample"]) >= Q["sample_chars"] for row in samples)
    text = (out / "lm_samples.txt").read_text(encoding="utf-8")
    assert text.count("--- prompt\n") == Q["samples"]
    assert [lm._shown(p) for p in re.findall(r"--- prompt\n(.*?\n)--- sample", text)] == [r["Prompt"] for r in samples]


def test_same_seed_same_checkpoint(tmp_path):
    same_seed_same_checkpoint(lm, tmp_path)


@pytest.mark.slow
def test_a_short_training_beats_the_bigram_on_held_out_docstrings(tmp_path, monkeypatch):
    # About 30 s on 2 cores: a third of the modules, a small model, 600 steps of 16 snippets (300 of
    # 32 ended level with the bigram on one machine and under it on another; this ends ~20% under).
    # Its figures are made but not rendered (a PNG signature only): the perplexities are what it checks,
    # and the quick run's report test checks the real pictures.
    monkeypatch.setattr(Figure, "savefig", _png_signature)
    monkeypatch.setattr(lm, "QUICK", {
        "modules": _corpus.MODULES[::3], "steps": 600, "warmup": 30, "batch_size": 16, "block_size": 64,
        "embed_dim": 64, "num_layers": 2, "ffn_dim": 256, "samples": 1, "sample_chars": 20, "probe_batch": 4})
    m = lm.run(out=tmp_path, quick=True, progress=False).metrics
    assert m["validation perplexity per char, GPT"] < m["validation perplexity per char, bigram"]


def test_the_report_shows_labels_for_people(trained):
    result, _ = trained
    assert app_report_problems(result) == []
    rows = {row["Metric"]: row["Value"] for row in result.evaluation_rows()}
    assert rows["Final training loss (nats per character, mean of the last 50 steps)"] == result.metrics["final_loss"]
