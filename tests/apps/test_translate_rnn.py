"""attnkit.apps.translate's baseline, a GRU encoder-decoder with additive attention: the score against a
float64 formula, padding, decoding, training, checkpoints, the command line and the comparison."""

from __future__ import annotations

import contextlib
import io
import math
import types
from functools import partial

import pytest
import torch
from torch.autograd import gradcheck

from attnkit.apps import _common
from attnkit.apps import translate as tr
from attnkit.apps._rnn import AdditiveAttention, RNNSeq2Seq
from attnkit.cli import main
from attnkit.cli import train as train_command
from tests.support import oracle
from tests.support.apps_checks import report_embeds_pictures, same_seed_same_checkpoint
from tests.support.tolerances import close
from tests.viz.test_report import app_report_problems


def _tiny(dtype=torch.float64):
    torch.manual_seed(0)
    return tr.build(tr.settings("rnn", quick=True, pairs="dates")).to(dtype).eval()


def _batch(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    train_days, _ = tr.split_days(g)
    src, skm, tgt = tr.make_batch(train_days[:n], g)
    assert (~skm).any() and skm.any(1).all()  # some rows are padded: the padding tests below test something
    return src, skm, tgt


def _teacher_input(tgt):
    return torch.cat([torch.full_like(tgt[:, :1], tr.BOS), tgt[:, :-1]], dim=1)


def _random_attention(g):
    att = AdditiveAttention(5, 6, 4).double()
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return att


def test_additive_attention_matches_the_formula_in_float64():
    """score(s, h) = v . tanh(W s + U h + b), written out with scalars; the oracle's softmax over the
    allowed keys (a row with one real key, a row with padding, a row without)."""
    g = torch.Generator().manual_seed(1)
    att = _random_attention(g)
    s = torch.randn(3, 5, generator=g, dtype=torch.float64)
    h = torch.randn(3, 7, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 1:] = False
    context, weights = att(s, att.project_keys(h), h, mask)

    w, u, b, v = (t.detach().tolist() for t in (att.q_proj.weight, att.k_proj.weight, att.k_proj.bias,
                                                  att.score_vector))
    sl, hl = s.tolist(), h.tolist()
    scores = torch.tensor([[sum(v[a] * math.tanh(sum(w[a][d] * sl[i][d] for d in range(5))
                                                 + sum(u[a][d] * hl[i][j][d] for d in range(6)) + b[a])
                                for a in range(4)) for j in range(7)] for i in range(3)], dtype=torch.float64)
    # The oracle's softmax(q k^T * scale + bias) v with the scores as the whole logit.
    out, expected = oracle.attention(torch.zeros(3, 1, 1, 1), torch.zeros(3, 1, 7, 1), h[:, None],
                                     allowed=mask[:, None, None, :], bias=scores[:, None, None, :], scale=0.0)
    close(weights, expected[:, 0, 0])
    close(context, out[:, 0, 0])
    assert weights[2, 0] == 1.0 and (weights[2, 1:] == 0).all()


def test_additive_attention_gradients():
    g = torch.Generator().manual_seed(2)
    att = _random_attention(g)
    s = torch.randn(2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert gradcheck(lambda s, h: att(s, att.project_keys(h), h, mask), (s, h))


def test_weights_sum_to_one_over_the_source_and_padding_changes_nothing():
    model = _tiny()
    src, skm, tgt = _batch()
    logits, weights = model.decode(_teacher_input(tgt), model.encode(src, skm), skm)  # (B, Lt, Ls)
    assert weights.shape == (len(src), tr.TGT_LEN, tr.SRC_LEN)
    close(weights.sum(-1), torch.ones(len(src), tr.TGT_LEN, dtype=torch.float64))
    assert (weights.masked_select(~skm[:, None, :]) == 0).all()
    # Whatever stands at the padded positions reaches neither the encoder's states nor the output.
    noisy = src.masked_fill(~skm, tr.SRC_VOCAB.index("thousand"))
    assert torch.equal(model(noisy, tgt, skm), logits)
    assert (model.encode(noisy, skm).states.masked_select(~skm[:, :, None]) == 0).all()


@pytest.mark.parametrize("mask, words", [
    (lambda m: m.flip(1), "True on a prefix of each row"),
    (lambda m: m & False, "a row without a real token"),
    (lambda m: m.long(), "must be a bool"),
])
def test_a_mask_the_encoder_cannot_read_is_refused(mask, words):
    model = _tiny()
    src, skm, _ = _batch()
    with pytest.raises(ValueError, match=words):
        model.encode(src, mask(skm))


def test_greedy_is_the_argmax_of_teacher_forcing_on_its_own_output():
    model = _tiny()
    src, skm, _ = _batch()
    ids, weights = tr.greedy_rnn(model, src, skm)
    assert torch.equal(tr.greedy(model, src, skm), ids)
    logits, forced = model.decode(_teacher_input(ids), model.encode(src, skm), skm)
    logits[..., tr.PAD] = float("-inf")
    for row, again, w, f in zip(ids.tolist(), logits.argmax(-1).tolist(), weights, forced, strict=True):
        n = row.index(tr.EOS) + 1 if tr.EOS in row else len(row)  # up to <eos>: PAD after it is not fed back
        assert row[:n] == again[:n]
        close(w[:n], f[:n])
    with pytest.raises(TypeError, match="for the RNN use greedy"):
        tr.beam_search(model, src, skm)


def test_a_few_training_steps_lower_the_loss():
    torch.manual_seed(0)
    model = tr.build(tr.settings("rnn", quick=True, pairs="dates"))
    batch = _batch(n=16)
    losses = _common.fit(model, lambda step: batch, tr.loss_fn, steps=12, lr=1e-2, desc="t", progress=False)
    assert sum(losses[-5:]) / 5 < 0.75 * losses[0], losses


def test_checkpoint_reloads_as_the_rnn_with_identical_outputs(tmp_path):
    torch.manual_seed(0)
    cfg = tr.settings("rnn", quick=True, pairs="dates")
    model = tr.build(cfg)
    src, skm, tgt = _batch()
    _common.fit(model, lambda step: (src, skm, tgt), tr.loss_fn, steps=3, lr=1e-2, desc="t", progress=False)
    _common.save(tmp_path, model, cfg)
    again = tr.load(tmp_path)
    assert isinstance(again, RNNSeq2Seq) and not again.training
    assert torch.equal(again(src, tgt, skm), model(src, tgt, skm))
    assert torch.equal(tr.greedy(again, src, skm), tr.greedy(model, src, skm))


@pytest.mark.parametrize("change, words", [
    ({"hidden_dim": 25}, "key 'hidden_dim' is 25, but 'decoder.weight_hh'"),
    ({"attn_dim": 0}, "'attn_dim'"),
    ({"model": "lstm"}, "key 'model' is 'lstm', expected one of \\['transformer', 'rnn'\\]"),
    ({"model": "transformer"}, "cannot be checked: model.safetensors has no tensor 'src_embed.embed.weight'"),
])
def test_a_config_that_does_not_fit_the_weights_is_refused(tmp_path, change, words):
    cfg = tr.settings("rnn", quick=True, pairs="dates")
    _common.save(tmp_path, tr.build(cfg), {**cfg, **change})
    with pytest.raises(ValueError, match=words):
        tr.load(tmp_path)


def test_models_and_their_names():
    assert tr.settings("rnn")["model"] == "rnn" and "num_heads" not in tr.settings("rnn")
    assert tr.settings()["model"] == "transformer" and "hidden_dim" not in tr.settings()
    assert train_command.MODELS["translate"] == tr.MODELS  # the command line's list, kept without torch
    with pytest.raises(ValueError, match="model must be one of 'transformer', 'rnn', got 'gru'"):
        tr.settings("gru")
    with pytest.raises(ValueError, match="layer must be 0 for the RNN"):
        tr.alignment_figure(_tiny(torch.float32), ["may", "first", "nineteen", "hundred"], layer=1)


def _run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv, words", [
    (["train", "translate", "--model", "lstm"], "argument --model: invalid choice: 'lstm'"),
    (["train", "vit", "--model", "rnn"], "--model rnn: task 'vit' cannot train it (it has no --model)"),
])
def test_a_wrong_model_is_one_line_before_training(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(tr, "run", lambda **kw: pytest.fail("training started"))
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_train_translate_model_rnn_trains_reports_and_saves_the_rnn(tmp_path, monkeypatch):
    results, real = [], tr.run
    monkeypatch.setattr(tr, "run", lambda **kw: results.append(real(**kw)) or results[-1])
    rc, out, err = _run_cli("train", "translate", "--model", "rnn", "--quick", "--steps", "5", "--out", str(tmp_path))
    assert rc == 0, err
    (result,) = results
    m = result.metrics
    assert m["model"] == "RNN with additive attention" and m["steps"] == 5 and m["ms_per_step"] > 0
    assert m["parameters"] == sum(p.numel() for p in tr.build(tr.settings("rnn", quick=True)).parameters())
    assert not any(k.startswith("beam") for k in m)  # the RNN decodes greedily only
    assert "RNN with additive attention" in out and "Milliseconds per training step" in out
    assert isinstance(tr.load(tmp_path), RNNSeq2Seq)
    assert "attnkit train translate --model rnn --quick" in (tmp_path / "report.html").read_text()
    assert report_embeds_pictures(result, tmp_path) == ["translate_alignment.png"]  # rewrites report.html
    assert app_report_problems(result) == []


def test_same_seed_same_checkpoint_for_the_rnn(tmp_path):
    same_seed_same_checkpoint(types.SimpleNamespace(run=partial(tr.run, model="rnn")), tmp_path)


def _trained(accuracy, n=400, step_seconds=0.01, steps=50):
    return tr.Trained(model=torch.nn.Linear(1, 1), config={"steps": steps, "batch_size": 8, "pairs": "dates"},
                      losses=[], step_seconds=step_seconds, train_seconds=0.0, test_days=torch.zeros(0),
                      held_out=(None, None, torch.zeros(n, tr.TGT_LEN)), greedy_exact=accuracy, greedy_chars=accuracy)


def test_the_verdict_says_what_was_measured_and_calls_a_gap_only_beyond_two_standard_errors():
    # Two standard errors of the difference at 0.5 and 0.5 with n = 400: 2 * sqrt(0.5 / 400) = 7.1 points.
    close_call = tr._verdict(_trained(0.50), _trained(0.55, step_seconds=0.02), seed=3)
    assert "50 training steps of 8 dates, seed 3, 400 held-out dates" in close_call
    assert "does not tell them apart" in close_call and "RNN / Transformer 2.00" in close_call
    apart = tr._verdict(_trained(0.50), _trained(0.60), seed=3)
    assert "the RNN wrote more" in apart and "does not tell" not in apart
    assert "the Transformer wrote more" in tr._verdict(_trained(0.9), _trained(0.5), seed=3)
    assert "0.0% for both, so this run does not tell them apart" in tr._verdict(_trained(0.0), _trained(0.0), seed=3)
    # 100% against 99%: 4 dates of 400; with one date right and one wrong added, two standard errors are 1.2 points.
    assert "does not tell them apart" in tr._verdict(_trained(1.0), _trained(0.99), seed=3)
    assert "the Transformer wrote more" in tr._verdict(_trained(1.0), _trained(0.98), seed=3)


def test_compare_trains_both_at_one_budget():
    result = tr.compare(quick=True, steps=2, progress=False, pairs="dates")
    assert [r["Model"] for r in result.rows] == ["Transformer", "RNN with additive attention"]
    assert all(r["Training steps"] == 2 and r["Milliseconds per training step (median)"] > 0 for r in result.rows)
    assert "2 training steps of 32 dates, seed 0, 64 held-out dates" in result.verdict
    assert str(result).endswith(result.verdict)
