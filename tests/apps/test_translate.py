"""attnkit.apps.translate at the QUICK size: the data, decoding with the KV cache, training, checkpoints, report."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import torch

from attnkit.apps import _common
from attnkit.apps import translate as tr
from attnkit.modules import MultiHeadAttention
from tests.support.apps_checks import report_embeds_pictures, same_seed_same_checkpoint
from tests.support.tolerances import close
from tests.viz.test_report import app_report_problems


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("translate")
    return out, tr.run(out=out, quick=True, progress=False, pairs="dates")


def _tiny_model(dtype=torch.float64):
    torch.manual_seed(0)
    return tr.build({**tr.DEFAULTS, **tr.QUICK, "pairs": "dates"}).to(dtype).eval()


def _batch(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    train_days, _ = tr.split_days(g)
    return tr.make_batch(train_days[:n], g)


def test_dates_in_words():
    assert " ".join(tr.in_words(dt.date(2026, 11, 23), 0)) == "twenty third of november two thousand twenty six"
    assert " ".join(tr.in_words(dt.date(1905, 1, 30), 1)) == "january thirtieth nineteen oh five"
    assert " ".join(tr.in_words(dt.date(1900, 5, 1), 0)) == "first of may nineteen hundred"
    assert " ".join(tr.in_words(dt.date(2000, 2, 12), 1)) == "february twelfth two thousand"
    assert " ".join(tr.in_words(dt.date(1987, 12, 31), 0)) == "thirty first of december nineteen eighty seven"


def test_every_day_has_one_phrase_per_style_that_fits():
    """The task is a function: no two days share a phrase, and every phrase fits the source length."""
    n = (tr.LAST_DAY - tr.FIRST_DAY).days + 1
    longest = 0
    for style in (0, 1):
        phrases = {tuple(tr.in_words(tr.FIRST_DAY + dt.timedelta(days=d), style)) for d in range(n)}
        assert len(phrases) == n
        longest = max(longest, *map(len, phrases))
    assert longest == tr.SRC_LEN


def test_held_out_days_are_not_trained_on():
    train_days, test_days = tr.split_days(torch.Generator().manual_seed(0))
    assert len(set(train_days.tolist()) & set(test_days.tolist())) == 0
    assert len(train_days) + len(test_days) == (tr.LAST_DAY - tr.FIRST_DAY).days + 1


def test_cached_decoding_equals_a_full_pass():
    """Decoding one token at a time through the KV cache gives the full teacher-forced pass's logits."""
    model = _tiny_model()
    src, skm, tgt = _batch()
    full = model(src, tgt, skm)  # (B, Lt, V)
    memory = model.encode(src, skm)
    caches = model.transformer.decoder.make_caches(len(src), tr.TGT_LEN)
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], tr.BOS), tgt[:, :-1]], dim=1)
    steps = [model.decode(tgt_in[:, t:t + 1], memory, skm, caches=caches) for t in range(tr.TGT_LEN)]
    close(torch.cat(steps, dim=1), full)


def test_greedy_and_beam_of_one_equal_argmax_without_cache():
    model = _tiny_model()
    src, skm, _ = _batch()
    # The same search done the slow way: a full forward pass per token, no cache.
    memory = model.encode(src, skm)
    seq = torch.full((len(src), 1), tr.BOS)
    for _ in range(tr.TGT_LEN):
        logits = model.decode(seq, memory, skm)[:, -1:]
        logits[..., tr.PAD] = float("-inf")  # PAD only ever fills a row after its <eos>
        seq = torch.cat([seq, logits.argmax(-1)], dim=1)
    expected = seq[:, 1:]
    got = tr.greedy(model, src, skm)
    for g, e in zip(got.tolist(), expected.tolist(), strict=True):
        assert tr.decode_chars(g) == tr.decode_chars(e)
    assert torch.equal(tr.beam_search(model, src, skm, beam=1), got)
    with pytest.raises(ValueError, match="beam must be a positive int"):
        tr.beam_search(model, src, skm, beam=0)


def test_beam_finds_the_most_likely_sequence_when_it_keeps_every_hypothesis():
    """With 3 target steps and a beam as wide as the vocabulary squared, beam search is exhaustive."""
    model = _tiny_model()
    model.tgt_len = 2  # a short target keeps the exhaustive check small
    src, skm, _ = _batch(n=3)
    v = len(tr.TGT_VOCAB)
    best = tr.beam_search(model, src, skm, beam=v * v)
    memory = model.encode(src, skm)
    # Score every sequence of 2 tokens (<eos> may end it early: then the second is PAD, probability 1).
    a, b = torch.meshgrid(torch.arange(v), torch.arange(v), indexing="ij")
    for i in range(len(src)):
        tgt_in = torch.stack([torch.full((v * v,), tr.BOS), a.flatten()], dim=1)
        logp = model.decode(tgt_in, memory[i:i + 1].expand(v * v, -1, -1), skm[i:i + 1].expand(v * v, -1))
        logp = logp.log_softmax(-1)
        first = logp[:, 0].gather(1, a.flatten()[:, None])[:, 0]
        second = torch.where(a.flatten() == tr.EOS, 0.0, logp[:, 1].gather(1, b.flatten()[:, None])[:, 0])
        # Sequences the search allows: no PAD while running, and after <eos> only PAD.
        allowed = (a.flatten() != tr.PAD) & torch.where(a.flatten() == tr.EOS, b.flatten() == tr.PAD,
                                                        b.flatten() != tr.PAD)
        j = torch.where(allowed, first + second, float("-inf")).argmax()
        expected = [a.flatten()[j].item(), b.flatten()[j].item()]
        assert best[i].tolist() == expected


def test_recording_cross_attention_leaves_outputs_alone_and_ignores_padding():
    model = _tiny_model()
    src, skm, tgt = _batch()
    plain = model(src, tgt, skm)
    with tr.recording_cross_attention(model) as rec:
        recorded = model(src, tgt, skm)
    close(recorded, plain)  # equal up to rounding: weights come from the reference backend
    (w,) = rec[-1]
    assert w.shape == (len(src), model.transformer.decoder.layers[-1].cross_attn.num_heads, tr.TGT_LEN, tr.SRC_LEN)
    close(w.sum(-1), torch.ones_like(w.sum(-1)))
    assert (w.masked_select(~skm[:, None, None, :]) == 0).all()
    assert not model.transformer.decoder.layers[-1].cross_attn._forward_hooks  # removed on exit


def test_attention_modules_are_the_librarys():
    model = _tiny_model()
    layers = model.transformer.encoder.layers
    dec = model.transformer.decoder.layers
    expected = [lay.self_attn for lay in layers] + [m for lay in dec for m in (lay.self_attn, lay.cross_attn)]
    assert all(isinstance(m, MultiHeadAttention) for m in expected)
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())


def test_checkpoint_reloads_to_identical_outputs(tmp_path):
    torch.manual_seed(0)
    cfg = {**tr.DEFAULTS, **tr.QUICK, "pairs": "dates"}
    model = tr.build(cfg)
    src, skm, tgt = _batch()
    _common.fit(model, lambda step: (src, skm, tgt), tr.loss_fn, steps=3, lr=1e-2, desc="t", progress=False)
    _common.save(tmp_path, model, cfg)
    again = tr.load(tmp_path)
    assert not again.training
    assert torch.equal(again(src, tgt, skm), model(src, tgt, skm))
    assert torch.equal(tr.beam_search(again, src, skm, beam=2), tr.beam_search(model, src, skm, beam=2))


@pytest.mark.slow  # seconds on a quiet CPU; a minute or more when 2 threads share a loaded one
def test_quick_run_learns_and_reports(quick_run):
    out, result = quick_run
    m = result.metrics
    assert result.task == "translate"
    assert m["final_loss"] < 0.5 * m["first_loss"]
    # Chance of writing a whole 10-character date right is nil; the quick run gets some right.
    assert m["greedy_exact"] > 0.1
    assert m[f"beam{tr.QUICK['beam']}_exact"] > 0.1
    assert tr.load(out).transformer.decoder.layers[0].cross_attn.embed_dim == tr.QUICK["embed_dim"]
    assert report_embeds_pictures(result, out) == ["translate_alignment.png"]


def test_same_seed_same_checkpoint(tmp_path):
    same_seed_same_checkpoint(tr, tmp_path)


def test_the_report_shows_labels_for_people(quick_run):
    _, result = quick_run
    assert app_report_problems(result) == []
    rows = {row["Metric"]: row["Value"] for row in result.evaluation_rows()}
    assert rows["Exact match, greedy decoding (share of held-out dates)"] == result.metrics["greedy_exact"]


def test_french_and_german_numbers_come_from_num2words_grammars():
    from attnkit.apps import _numbers

    assert _numbers.french(97) == ["quatre", "vingt", "dix", "sept"] and _numbers.german(97) == "siebenundneunzig"
    assert _numbers.french(71) == ["soixante", "et", "onze"] and _numbers.german(71) == "einundsiebzig"
    pairs = _numbers.pairs()
    assert len(pairs) == _numbers.LAST and pairs[0] == (("un",), "eins")
    # The fixed vocabularies and lengths hold every pair, and are no larger than they need to be.
    assert {w for src, _ in pairs for w in src} == set(_numbers.FRENCH_WORDS)
    assert {c for _, tgt in pairs for c in tgt} == set(_numbers.GERMAN_CHARS)
    assert max(len(src) for src, _ in pairs) == _numbers.SRC_LEN
    assert max(len(tgt) for _, tgt in pairs) + 1 == _numbers.TGT_LEN


def test_a_numbers_batch_is_padded_and_ends_each_target_with_eos():
    g = torch.Generator().manual_seed(0)
    train, test = tr.split(g, tr.NUMBERS)
    assert len(train) + len(test) == 9999 and len(set(train.tolist()) & set(test.tolist())) == 0
    items = torch.tensor([96, 0])  # the numbers 97 and 1
    src, skm, tgt = tr.make_batch(items, g, tr.NUMBERS)
    assert src.shape == (2, tr.NUMBERS.src_len) and tgt.shape == (2, tr.NUMBERS.tgt_len)
    assert [tr.NUMBERS.src_vocab[i] for i in src[0, :4]] == ["quatre", "vingt", "dix", "sept"]
    assert skm[0].tolist() == [True] * 4 + [False] * (tr.NUMBERS.src_len - 4)
    assert skm[1].tolist() == [True] + [False] * (tr.NUMBERS.src_len - 1)
    assert tr.decode_chars(tgt[0].tolist(), tr.NUMBERS.tgt_vocab) == "siebenundneunzig"
    assert tgt[1, :5].tolist() == tr.encode_chars("eins", tr.NUMBERS.tgt_vocab) + [tr.EOS]
    assert (tgt[1, 5:] == tr.PAD).all()
    model = tr.build({**tr.settings(quick=True), "pairs": "fr-de"})
    assert tr.greedy(model, src, skm).shape == (2, tr.NUMBERS.tgt_len)


def test_the_character_score_is_one_minus_edit_distance_over_length():
    assert tr.edit_distance("siebzig", "siebzig") == 0 and tr.edit_distance("siebzig", "sibzig") == 1
    assert tr.edit_distance("", "acht") == 4 and tr.edit_distance("kitten", "sitting") == 3
    v = tr.NUMBERS.tgt_vocab

    def ids(text):
        return tr.encode_chars(text, v) + [tr.EOS] + [tr.PAD] * (8 - len(text))

    pred, tgt = torch.tensor([ids("achtzig"), ids("acht")]), torch.tensor([ids("achtzig"), ids("achtzig")])
    assert tr.char_similarity(pred, tgt, v) == pytest.approx((1.0 + (1 - 3 / 7)) / 2)
    assert tr.exact_match(pred, tgt, v) == 0.5


def test_pairs_are_checked_before_training():
    with pytest.raises(ValueError, match="pairs must be one of 'fr-de', 'dates', got 'en-fr'"):
        tr.run(out=Path("unused"), pairs="en-fr")
    assert tr.settings()["pairs"] == "fr-de" and tr.pairs_of({}) is tr.DATES  # an old checkpoint: dates
    assert train_command_pairs() == tuple(tr.PAIRS)


def train_command_pairs():
    from attnkit.cli import train as train_command

    return train_command.PAIRS["translate"]
