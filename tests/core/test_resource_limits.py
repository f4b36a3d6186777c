"""Resource limits on what attnkit reads and computes: an app checkpoint's config is checked against its
weights before a model is built; approximate attention refuses sizes that cannot fit, and names what
it is missing."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import attnkit.approx as approx
from attnkit.approx import kernel
from attnkit.apps import _common, task

# ---------------------------------------------------------------- app checkpoints

#: The tasks whose load declares its config keys (``FIELDS``); a task added later joins by declaring them.
CHECKED = ("vit", "caption", "translate", "classify", "recommend", "lm")
#: Tasks whose keys have other names (the generic hostile configs below do not apply): own cases only.
OWN_NAMES = ("recall",)
_BUILD = {name: task(name).build for name in CHECKED + OWN_NAMES}  # the real ones, for tests that replace them


def _config(name: str) -> dict:
    m = task(name)
    cfg = {**m.DEFAULTS, **m.QUICK}
    if name == "classify":
        cfg["vocab"] = ["<pad>", "<unk>", "river", "bank"]
    if name == "vit":
        cfg["model"] = "vit"
    if name == "lm":
        cfg.update(vocab_size=12, chars="abcdefghijk")
    return cfg


@pytest.fixture(params=CHECKED + OWN_NAMES)
def saved_any(request, tmp_path):
    return _saved(request.param, tmp_path)


@pytest.fixture(params=CHECKED)
def saved(request, tmp_path):
    return _saved(request.param, tmp_path)


def _saved(name, tmp_path):
    """(task module, config, the saved model in eval mode, its folder) for each task, quick sizes."""
    m = task(name)
    cfg = _config(name)
    torch.manual_seed(0)
    model = _BUILD[name](cfg).eval()
    _common.save(tmp_path, model, cfg)
    return m, cfg, model, tmp_path


def _layers_key(cfg: dict) -> str:
    return "num_layers" if "num_layers" in cfg else "encoder_layers"


def _write(folder, cfg):
    (folder / "config.json").write_text(json.dumps(cfg))


def test_each_task_loads_what_it_saved_bit_for_bit(saved_any):
    m, cfg, model, folder = saved_any
    back = m.load(folder)
    assert not back.training and back.state_dict().keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert not any(p.is_meta for p in back.parameters())
    g = torch.Generator().manual_seed(1)
    inputs = {"vit": lambda: torch.rand(3, 8, 8, generator=g),  # the models whose forward takes one tensor
              "classify": lambda: torch.randint(0, 4, (3, 6), generator=g),
              "recommend": lambda: torch.randint(1, cfg.get("num_items", 2), (3, 6), generator=g)}
    name = m.__name__.rsplit(".")[-1]
    if name in inputs:
        x = inputs[name]()
        with torch.no_grad():
            assert torch.equal(back(x), model(x))


@pytest.fixture
def never_built(monkeypatch):
    """Each task's build fails the test: a refusal must come before anything is built."""
    def built(config):
        raise AssertionError("the model was built before config.json was checked against the weights")

    for name in CHECKED + OWN_NAMES:
        monkeypatch.setattr(task(name), "build", built)


# Before: num_layers 10**5 built for over 40 s; embed_dim 2**20 tried to allocate 4.4 TB; a missing
# key was a KeyError, a string a TypeError, a deep file a RecursionError.
@pytest.mark.parametrize("change, pattern", [
    ("layers", r"config\.json: key '(num|encoder)_layers' is 100,000, but model\.safetensors holds \d+ \("),
    ({"embed_dim": 2**20}, r"config\.json: key 'embed_dim' is 1,048,576, but '[\w.]+' in model\.safetensors has shape"),
    ({"num_heads": "4"}, r"config\.json: key 'num_heads' must be int, got '4'"),
    ({"num_heads": 5}, r"config\.json: key 'num_heads' \(5\) must divide 'embed_dim' \(\d+\)"),
    ({"num_heads": 10**40}, r"config\.json: key 'num_heads' is a 41-digit number"),
    ({"embed_dim": None}, r"config\.json: key 'embed_dim' is missing"),
    ({"ffn_dim": -3}, r"config\.json: key 'ffn_dim' must be positive, got -3"),
])
def test_a_hostile_config_is_refused_before_building(saved, never_built, change, pattern):
    m, cfg, _, folder = saved
    cfg = dict(cfg)
    for k, v in ({_layers_key(cfg): 10**5} if change == "layers" else change).items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    _write(folder, cfg)
    with pytest.raises(ValueError, match=pattern):
        m.load(folder)


@pytest.mark.parametrize("name, change, pattern", [
    ("vit", {"patch": 4}, r"key 'patch' is 4, but 'embed\.weight' in model\.safetensors has shape \(32, 4\) "
                          r"\(dimension 1 would be 16\)"),
    ("vit", {"model": "resnet"}, r"key 'model' is 'resnet', expected one of \['vit', 'cnn'\]"),
    ("vit", {"dropout": 2.0}, r"key 'dropout' must be a probability in \[0, 1\], got 2\.0"),
    ("classify", {"vocab": ["a"] * 7},
     r"key 'vocab' has 7 entries, but model\.safetensors stores 4 rows of 'embed\.weight'"),
    ("classify", {"vocab": "abc"}, r"key 'vocab' must be a list of strings, got str"),
    ("recommend", {"num_items": 10**6}, r"key 'num_items' is 1,000,000, but 'item\.weight' in model\.safetensors"),
    ("lm", {"block_size": 10**6}, r"key 'block_size' is 1,000,000, but 'pos\.weight' in model\.safetensors"),
    ("lm", {"vocab_size": 7}, r"key 'vocab_size' is 7, but 'tok\.weight' in model\.safetensors has shape"),
    ("recall", {"attn_heads": 5}, r"key 'attn_heads' \(5\) must divide 'embed_dim' \(\d+\)"),
    ("recall", {"attn_layers": 10**5}, r"key 'attn_layers' is 100,000, but model\.safetensors holds \d+ \("),
    ("recall", {"lstm_hidden": 2**20}, r"key 'lstm_hidden' is 1,048,576, but 'LSTM\.head\.weight'"),
    ("recall", {"num_values": "8"}, r"key 'num_values' must be int, got '8'"),
    ("translate", {"decoder_layers": 3}, r"key 'decoder_layers' is 3, but model\.safetensors holds 1 "
                                         r"\(transformer\.decoder\.layers\.0\)"),
])
def test_task_specific_keys_are_checked(tmp_path, never_built, name, change, pattern):
    m, cfg = task(name), _config(name)
    _common.save(tmp_path, _BUILD[name](cfg), cfg)
    _write(tmp_path, {**cfg, **change})
    with pytest.raises(ValueError, match=pattern):
        m.load(tmp_path)


def test_a_deeply_nested_or_oversized_config_is_refused(tmp_path, never_built):
    _common.save(tmp_path, _BUILD["recommend"](_config("recommend")), _config("recommend"))
    (tmp_path / "config.json").write_text('{"num_items": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"config\.json: nested more than 32 levels deep under key \"num_items\""):
        task("recommend").load(tmp_path)
    _write(tmp_path, {**_config("recommend"), "notes": "x" * (9 * 2**20)})
    with pytest.raises(ValueError, match=r"config\.json is 9,4\d\d,\d{3} bytes, more than the 8,388,608"):
        task("recommend").load(tmp_path)


def test_weights_of_another_model_are_named_tensor_by_tensor(tmp_path):
    _common.save(tmp_path, nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), {"hidden": 8})
    with pytest.raises(ValueError, match=r"model\.safetensors: weights do not fit the model built from config\.json: "
                                         r"'1\.weight' stored \(2, 8\), model has \(3, 8\); '1\.bias' stored"):
        _common.load(tmp_path, lambda c: nn.Sequential(nn.Linear(4, c["hidden"]), nn.Linear(c["hidden"], 3)))
    with pytest.raises(ValueError, match=r"config\.json: cannot build the model from it \(KeyError: 'width'\)"):
        _common.load(tmp_path, lambda c: nn.Linear(4, c["width"]))
    # A load that declares no keys still names the file when no allocator takes a size (2**62 elements here).
    with pytest.raises(ValueError, match=r"config\.json: cannot build the model from it \(RuntimeError: "):
        _common.load(tmp_path, lambda c: nn.Linear(2**31, 2**31))


def test_a_loaded_model_keeps_the_buffers_it_computes(tmp_path):
    """A rotary table is not in the file: built with the parameters on the meta device, it is still right."""
    from attnkit import MultiHeadAttention
    from attnkit.positional import RotaryEmbedding

    def build(c):
        return MultiHeadAttention(c["width"], 2, rotary=RotaryEmbedding(c["width"] // 2))

    torch.manual_seed(0)
    model = build({"width": 16}).eval()
    _common.save(tmp_path, model, {"width": 16})
    back = _common.load(tmp_path, build)
    assert torch.equal(back.rotary.inv_freq, model.rotary.inv_freq)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


# ---------------------------------------------------------------- approximate attention

@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [
    lambda: approx.attention(*[torch.randn(1, 2, 5, 64)] * 3, kind="performer", num_features=10**9),
    lambda: approx.ApproxAttention("performer", num_heads=2, head_dim=64, num_features=10**9),
    lambda: kernel.orthogonal_features(10**9, 64),
])
def test_performer_features_that_cannot_fit_are_refused_naming_the_size(make):
    """Before: num_features=10**9 drew QR blocks for well past 60 s before running out of memory."""
    with pytest.raises(ValueError, match=r"performer: num_features=1,000,000,000 with head_dim=64 .* needs 953\.7 GiB, "
                                         r"more than the [\d.]+ \w+ of memory this machine has"):
        make()


def test_random_feature_map_that_cannot_fit_is_refused():
    with pytest.raises(ValueError, match=r"performer: num_features=10,000,000,000 with head_dim=64 needs 4\.7 TiB"):
        kernel.random_feature_map(64, 10**10)


def test_a_call_whose_features_cannot_fit_is_refused(monkeypatch):
    """Causal FAVOR+ builds every token's features at once: 2 heads x 64 features x (3 x 1024 tokens + 9) x 4 bytes."""
    monkeypatch.setattr(kernel, "memory_limit", lambda device=None: 2**20)
    q = torch.randn(1, 2, 512, 8)
    with pytest.raises(ValueError, match=r"performer: num_features=64 over 2 heads \(all 1,024 tokens' at once "
                                         r"\(causal\) features, torch\.float32\) needs 1\.5 MiB, more than "
                                         r"the 1\.0 MiB"):
        approx.attention(q, q, q, kind="performer", num_features=64, is_causal=True)
    approx.attention(q, q, q, kind="performer", num_features=64, chunk_size=16)  # 16 tokens at a time fit


def test_orthogonal_features_draw_what_they_drew_before():
    """Written into one tensor instead of concatenated blocks (half the peak memory): the same numbers per seed."""
    import math

    def before(m, d, g):
        blocks = []
        for _ in range(math.ceil(m / d)):
            qr = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
            blocks.append((qr.Q * qr.R.diagonal().sign()).transpose(0, 1))
        return torch.cat(blocks)[:m] * torch.randn(m, d, generator=g, dtype=torch.float64).norm(dim=1)[:, None]

    for m, d in ((64, 16), (10, 16), (37, 8), (1, 1)):
        assert torch.equal(kernel.orthogonal_features(m, d, generator=torch.Generator().manual_seed(3)),
                           before(m, d, torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("kind, args, error, pattern", [
    ("linformer", {}, ValueError, r"linformer needs projection=: a LinformerProjection\(max_len, k\)"),
    ("additive", {}, ValueError, r"additive needs score_vector=: the score's vector w, \[A\] or per head \[H, A\]"),
    ("multiplicative", {}, ValueError, r"multiplicative needs weight=: the score's matrix W, \[E, E\]"),
    ("additive", {"score_vector": [1.0, 2.0]}, TypeError, r"additive: score_vector must be a torch\.Tensor, got list"),
])
def test_a_missing_kind_argument_is_named(kind, args, error, pattern):
    """Before: TypeError: linformer_attention() missing 1 required keyword-only argument: 'projection'."""
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(error, match=pattern):
        approx.attention(q, q, q, kind=kind, **args)


@pytest.mark.parametrize("chars, got", [(["a", "b"], "list"), ("aba", "repeated characters"), (None, "NoneType")])
def test_a_language_model_vocabulary_must_be_distinct_characters(tmp_path, chars, got):
    from attnkit.apps import lm

    _write(tmp_path, {"chars": chars})
    with pytest.raises(ValueError, match=rf"config\.json: key 'chars' must be a string of distinct characters, "
                                         rf"got {got}"):
        lm.load_vocab(tmp_path)
