"""hkt.integrations.transformers: every model family of the matrix below
(decoders and encoders, separate and fused projections), built from tiny
configs with random weights (nothing is downloaded), and in depth on two
families with grouped-query heads (Llama, Qwen2)."""
import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed (pip install 'hkt[transformers]')")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import hkt  # noqa: E402
import hkt.integrations.transformers as ht  # noqa: E402

VOCAB = 96
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}

# initializer_range: weights large enough that attention is far from uniform, so that
# the coarse levels, once trained, change the function visibly
_TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, **_TOKENS)
_GQA = dict(_SIZES, num_key_value_heads=2)
_FULL = ["full_attention", "full_attention"]  # the local layers' window off (WINDOWED below turns it on)
# family: (config class, model class, config options); every one routes its
# attention through transformers' AttentionInterface
MATRIX = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _GQA),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_GQA, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _GQA),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_GQA, head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_GQA, head_dim=8)),
    # with its default attn_logit_softcapping (50.0): hkt caps the combined score as Gemma 2 does
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_GQA, head_dim=8, layer_types=_FULL)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_GQA, head_dim=8, layer_types=_FULL)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_GQA, sliding_window=None)),  # fused qkv_proj
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _GQA),
    "granite": ("GraniteConfig", "GraniteForCausalLM", _GQA),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(_GQA, sliding_window=None)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _SIZES),  # fused query_key_value
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                                   **_TOKENS)),  # fused c_attn (Conv1D)
    "bert": ("BertConfig", "BertModel", _SIZES),  # bidirectional
    "roberta": ("RobertaConfig", "RobertaModel", dict(_SIZES, pad_token_id=1, bos_token_id=0)),
}
ENCODERS = ("bert", "roberta")
# the matrix's families with a sliding window of 4 positions, shorter than the test
# sequences (13 tokens; 9 + 6 generated), and each layer's window
_MIXED = ["sliding_attention", "full_attention"]
WINDOWED = {
    "mistral": (dict(sliding_window=4), [4, 4]),
    "qwen2": (dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), [None, 4]),
    "gemma2": (dict(sliding_window=4, layer_types=_MIXED), [4, None]),
    "gemma3": (dict(sliding_window=4, layer_types=_MIXED), [4, None]),
    # Mistral's way (the config's window, every layer): at conversion only
    "starcoder2": (dict(sliding_window=4), [4, 4]),
    "phi3": (dict(sliding_window=4), [4, 4]),
}
_WINDOWED_IN_DEPTH = ("mistral", "qwen2", "gemma2", "gemma3")


def build(family: str, seed: int = 0, **overrides):
    """A tiny model of the matrix's family, random weights, eval mode."""
    config_class, model_class, options = MATRIX[family]
    config = getattr(transformers, config_class)(**dict(options, **overrides))
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config).eval()


def output(model, x, mask=None):
    """The logits of a decoder, the last hidden states of an encoder."""
    out = model(x, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def padded(family: str, B: int = 3, T: int = 13):
    """Tokens and mask of a batch with rows padded on the right (as tokenizers
    pad for an encoder) or the left (for a decoder's generation)."""
    x = ids(B, T)
    mask = torch.ones_like(x)
    for row, n in ((1, 4), (2, 7)):
        cut = slice(T - n, T) if family in ENCODERS else slice(0, n)
        x[row, cut], mask[row, cut] = MATRIX[family][2].get("pad_token_id", 0), 0
    return x, mask


def tiny(family: str, seed: int = 0):
    config_class, model_class = FAMILIES[family]
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query heads
    return model


def scramble(model, seed: int = 1):
    """Random HKT parameters, so that the coarse levels change the output (at
    conversion they contribute nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ht.HKTLevels) and m.levels > 1:
                for p in (m.q_downsample, m.k_downsample):
                    p.copy_(0.5 + 0.3 * torch.randn(p.shape, generator=g))
                m.coarse_q_proj.copy_(0.4 * torch.randn(m.coarse_q_proj.shape, generator=g))
                m.coarse_k_proj.add_(0.2 * torch.randn(m.coarse_k_proj.shape, generator=g))
                m.level_logits.copy_(0.5 * torch.randn(m.level_logits.shape, generator=g))
    return model


def ids(B, T, seed=3):
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _added(model):
    return {n: p for n, p in model.named_parameters() if ".hkt." in n}


@pytest.mark.parametrize("family", MATRIX)
@pytest.mark.parametrize("levels,tol", [(1, 2e-5), (3, 2e-4)])
def test_family_converts_exactly(family, levels, tol):
    """levels=1 is the model's attention on hkt's kernels; levels=3 at
    conversion computes what the model computed (a padded batch: the tokens'
    outputs; a padding position's is not a token's)."""
    base = build(family)
    x, mask = padded(family)
    with torch.no_grad():
        want = output(base, x, mask)
    model = ht.convert(copy.deepcopy(base), levels=levels)
    layers = [m for m in model.modules() if isinstance(m, ht.HKTLevels)]
    assert len(layers) == base.config.num_hidden_layers
    real = mask.bool()
    with torch.no_grad():
        assert rel(output(model, x, mask)[real], want[real]) <= tol
        if levels > 1:  # the coarse levels are live: trained parameters change the function
            assert rel(output(scramble(model), x, mask)[real], want[real]) > 1e-2


@pytest.mark.parametrize("family", MATRIX)
def test_family_trains_every_added_parameter(family):
    _trains_every_added_parameter(family, build(family))


def _trains_every_added_parameter(family, base, **options):
    model = ht.convert(base, levels=3, **options).train()
    added = _added(model)
    assert len(added) == 5 * model.config.num_hidden_layers
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, mask = padded(family)
    target = torch.randn(output(model, x, mask).shape, generator=torch.Generator().manual_seed(5))
    reached = set()
    for _ in range(3):
        opt.zero_grad()
        # a random target: an encoder's layer-normed states have a constant mean square
        loss = (output(model, x, mask) * target)[mask.bool()].mean()
        loss.backward()
        reached |= {n for n, p in added.items() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
        opt.step()
    assert reached == set(added)


@pytest.mark.parametrize("family", MATRIX)
def test_family_save_and_load(family, tmp_path):
    model = scramble(ht.convert(build(family), levels=3))
    model.save_pretrained(tmp_path)
    loaded = ht.from_pretrained(type(model), str(tmp_path)).eval()
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    x, mask = padded(family)
    with torch.no_grad():
        assert torch.equal(output(model, x, mask), output(loaded, x, mask))


@pytest.mark.parametrize("family", [f for f in MATRIX if f not in ENCODERS])
def test_family_generate_with_cache_equals_without(family):
    model = scramble(ht.convert(build(family), levels=3))
    x, mask = padded(family, T=9)
    out = [model.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, use_cache=c) for c in (True, False)]
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel(torch.stack(out[0].logits, 1), torch.stack(out[1].logits, 1)) < 1e-4


def test_cross_attention_converts_with_one_level_only():
    """GPT-2 with cross-attention blocks: their keys are another sequence's,
    which HKT's coarse levels (self-attention) do not cover."""
    with pytest.raises(ValueError, match="GPT2Attention .* is cross-attention.*convert with levels=1"):
        ht.convert(build("gpt2", add_cross_attention=True), levels=3)
    base = build("gpt2", add_cross_attention=True)
    x, encoded = ids(2, 7), torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = base(x, encoder_hidden_states=encoded).logits
        model = ht.convert(base, levels=1)
        assert sum(isinstance(m, ht.HKTLevels) for m in model.modules()) == 4  # self and cross, 2 layers
        assert rel(model(x, encoder_hidden_states=encoded).logits, want) <= 2e-5


@pytest.mark.parametrize("family", ENCODERS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_encoder_padding_equals_the_row_alone(family, side):
    """Bidirectional HKT with trained coarse levels: a padded row's tokens get
    what the row alone gets (its blocks are formed from its tokens only)."""
    model = scramble(ht.convert(build(family), levels=3))
    x, mask = padded(family)
    if side == "left":
        x, mask = x.flip(1), mask.flip(1)
    with torch.no_grad():
        # the positions the row alone has (RoBERTa counts them from its tokens, BERT is told)
        positions = (mask.cumsum(-1) - 1).clamp(min=0) if family == "bert" else None
        got = model(x, attention_mask=mask, position_ids=positions).last_hidden_state
        for row in range(x.shape[0]):
            real = mask[row].bool()
            alone = output(model, x[row:row + 1, real])[0]
            assert rel(got[row, real], alone) < 1e-5, row


def _gemma2_capped(cap=1.0, **overrides):
    """Gemma 2 with a cap small enough to change its logits (its default, 50,
    barely touches the tiny model's scores), checked to."""
    base = build("gemma2", attn_logit_softcapping=cap, **overrides)
    x, mask = padded("gemma2")
    real = mask.bool()
    with torch.no_grad():
        uncapped = output(build("gemma2", attn_logit_softcapping=None, **overrides), x, mask)
        assert rel(output(base, x, mask)[real], uncapped[real]) > 1e-2
    return base


@pytest.mark.parametrize("levels,tol", [(1, 2e-5), (3, 2e-4)])
@pytest.mark.parametrize("layers", ["full", "mixed"])
def test_gemma2_soft_capping_converts_exactly(levels, tol, layers):
    """Gemma 2's attn_logit_softcapping reaches hkt_attention's softcap: at
    conversion the model computes what it computed, its local layers (a
    sliding window of 4) on the dense masked path."""
    extra = {} if layers == "full" else dict(sliding_window=4, layer_types=_MIXED)
    base = _gemma2_capped(**extra)
    x, mask = padded("gemma2")
    real = mask.bool()
    with torch.no_grad():
        want = output(base, x, mask)
        model = ht.convert(copy.deepcopy(base), levels=levels)
        assert rel(output(model, x, mask)[real], want[real]) <= tol


def test_gemma2_soft_capping_trains_every_added_parameter():
    _trains_every_added_parameter("gemma2", _gemma2_capped())


@pytest.mark.parametrize("layers", ["full", "mixed"])
def test_gemma2_soft_capping_generate_with_cache_equals_without(layers):
    extra = {} if layers == "full" else dict(sliding_window=4, layer_types=_MIXED)
    model = scramble(ht.convert(_gemma2_capped(**extra), levels=3))
    x, mask = padded("gemma2", T=9)
    out = [model.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, use_cache=c) for c in (True, False)]
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel(torch.stack(out[0].logits, 1), torch.stack(out[1].logits, 1)) < 1e-4


def windowed(family: str, seed: int = 0):
    """The family's tiny model with its sliding window on (WINDOWED), checked
    to compute something else than the same weights without it on a padded
    batch, so that a conversion that ignored the window would fail."""
    options, windows = WINDOWED[family]
    model = build(family, seed, **options)
    assert [ht.attention._windowed(m) for m in ht.conversion._attention_modules(model)] == windows
    x, mask = padded(family)
    real = mask.bool()
    with torch.no_grad():
        assert rel(output(build(family, seed), x, mask)[real], output(model, x, mask)[real]) > 1e-2
    return model


@pytest.mark.parametrize("family", WINDOWED)
@pytest.mark.parametrize("levels,tol", [(1, 2e-5), (3, 2e-4)])
def test_sliding_window_converts_exactly(family, levels, tol):
    """Each layer keeps its window: levels=1 is the model's attention with its
    own mask, levels=3 at conversion sees exactly the keys the model's mask
    lets the layer see (a padded batch)."""
    base = windowed(family)
    x, mask = padded(family)
    with torch.no_grad():
        want = output(base, x, mask)
    model = ht.convert(copy.deepcopy(base), levels=levels)
    real = mask.bool()
    with torch.no_grad():
        assert rel(output(model, x, mask)[real], want[real]) <= tol
        if levels > 1:
            assert rel(output(scramble(model), x, mask)[real], want[real]) > 1e-2


@pytest.mark.parametrize("levels", [1, 3])
def test_sliding_window_runs_on_the_band(levels, monkeypatch):
    """A sliding-window layer's prompt reaches the kernels with its window as
    their band (``sliding_window``, T x window work), and at levels=3 its
    decoding steps reach the decoding kernel with it too; the same logits
    as the original (levels=1) and as the uncached forward (levels=3, trained
    levels) over a left-padded batch generated past the window."""
    base = windowed("mistral")
    window = base.config.sliding_window
    model = ht.convert(copy.deepcopy(base), levels=levels)
    if levels > 1:
        scramble(model)
    seen = {"prompt": [], "step": []}
    attention, with_kvcache = hkt.hkt_attention, hkt.kvcache.hkt_attention_with_kvcache

    def prompt(*a, **kw):
        seen["prompt"].append(kw.get("sliding_window"))
        return attention(*a, **kw)

    def step(*a, **kw):
        seen["step"].append(kw.get("sliding_window"))
        return with_kvcache(*a, **kw)
    monkeypatch.setattr(hkt, "hkt_attention", prompt)
    monkeypatch.setattr(hkt.decoding.level_cache, "hkt_attention_with_kvcache", step)
    x, mask = padded("mistral", T=9)
    seq, logits = _greedy(model, x, mask)
    layers = base.config.num_hidden_layers
    assert seen["prompt"][:layers] == [window] * layers
    if levels > 1:
        assert seen["step"] and set(seen["step"]) == {window}
        monkeypatch.setattr(hkt, "hkt_attention", attention)
        want, want_logits = _greedy(model, x, mask, use_cache=False)
    else:
        monkeypatch.setattr(hkt, "hkt_attention", attention)
        want, want_logits = _greedy(base, x, mask)
    assert torch.equal(seq, want)
    assert rel(logits, want_logits) < 1e-4


@pytest.mark.parametrize("family", _WINDOWED_IN_DEPTH)
def test_sliding_window_trains_every_added_parameter(family):
    _trains_every_added_parameter(family, windowed(family))


def _greedy(model, x, mask, use_cache=True):
    out = model.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, use_cache=use_cache)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("family", _WINDOWED_IN_DEPTH)
def test_sliding_window_generate(family):
    """Greedy generation past the window, left-padded: levels=1 (transformers'
    cache, which keeps the last window of keys of a local layer) and levels=3 at
    conversion (a cache that keeps every key) give the original's tokens;
    levels=3 with trained levels gives the same tokens with the cache as without."""
    base = windowed(family)
    x, mask = padded(family, T=9)
    want, want_logits = _greedy(base, x, mask)
    for levels in (1, 3):
        seq, logits = _greedy(ht.convert(copy.deepcopy(base), levels=levels), x, mask)
        assert torch.equal(seq, want), levels
        assert rel(logits, want_logits) < 1e-4, levels
    model = scramble(ht.convert(base, levels=3))
    (seq, logits), (seq_nc, logits_nc) = _greedy(model, x, mask), _greedy(model, x, mask, use_cache=False)
    assert torch.equal(seq, seq_nc)
    assert rel(logits, logits_nc) < 1e-4


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_cached_chunks_equal_the_whole_sequence(family):
    """Several tokens per cached step, in a cache built from the config (its
    local layers' sliding-window layers, replaced while empty)."""
    model = scramble(ht.convert(windowed(family), levels=3))
    x = ids(2, 17)
    with torch.no_grad():
        want = model(x, use_cache=False).logits
        got = _stepwise(model, x, [5, 1, 3, 1, 7])
    assert rel(got, want) < 1e-4


def test_a_filled_sliding_window_cache_is_refused():
    """A cache whose local layers already dropped the keys before their window
    (filled by the unconverted model): the coarse levels would need them."""
    base = windowed("mistral")
    x = ids(1, 10)
    cache = DynamicCache(config=base.config)
    with torch.no_grad():
        base(x[:, :8], cache=cache, use_cache=True)
        model = ht.convert(copy.deepcopy(base), levels=3)
        with pytest.raises(NotImplementedError, match="keeps only a sliding window"):
            model(x[:, 8:9], cache=cache, use_cache=True)


def test_registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert AttentionInterface._global_mapping["hkt"] is ht.hkt_attention_forward
    assert "hkt" in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("levels,tol", [(1, 1e-5), (3, 1e-4)])
def test_convert_keeps_the_function(family, levels, tol):
    base = tiny(family)
    x = ids(2, 21)
    want = base(x).logits
    model = ht.convert(copy.deepcopy(base), levels=levels)
    assert model.config._attn_implementation == "hkt"
    assert model.config.hkt == {"levels": levels, "downsample_kernel": 2, "level0_weight": 0.5}
    got = model(x).logits
    assert rel(got, want) < tol
    if levels > 1:  # the coarse levels are live: trained parameters change the function
        assert rel(scramble(model)(x).logits, want) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_training_reaches_every_added_parameter(family):
    model = ht.convert(tiny(family), levels=3).train()
    added = {n: p for n, p in model.named_parameters() if ".hkt." in n}
    assert len(added) == 5 * model.config.num_hidden_layers
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = ids(2, 17)
    reached = set()
    for _ in range(3):
        opt.zero_grad()
        loss = model(x, labels=x).loss
        loss.backward()
        reached |= {n for n, p in added.items() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
        opt.step()
    assert reached == set(added)


def _generate(model, x, **kw):
    out = model.generate(x, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         **kw)
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("levels,kernel", [(3, 2), (4, 3), (1, 2)])
def test_generate_with_cache_equals_without(family, levels, kernel):
    model = scramble(ht.convert(tiny(family), levels=levels, downsample_kernel=kernel))
    x = ids(2, 11)
    seq, logits = _generate(model, x)
    seq_nc, logits_nc = _generate(model, x, use_cache=False)
    assert torch.equal(seq, seq_nc)
    assert rel(logits, logits_nc) < 1e-4


def test_one_level_steps_run_the_decoding_kernel(monkeypatch):
    """levels=1, one new token without padding (generate's step): the
    decoding kernel over transformers' cache, the original's tokens and
    logits."""
    base = tiny("llama")
    model = ht.convert(copy.deepcopy(base), levels=1)
    calls = []
    with_kvcache = hkt.hkt_attention_with_kvcache
    monkeypatch.setattr(hkt, "hkt_attention_with_kvcache", lambda *a, **kw: calls.append(1) or with_kvcache(*a, **kw))
    x = ids(1, 11)
    seq, logits = _generate(model, x)
    want, want_logits = _generate(base, x)
    assert len(calls) == 11 * base.config.num_hidden_layers
    assert torch.equal(seq, want)
    assert rel(logits, want_logits) < 1e-5


def _stepwise(model, x, chunks):
    """Logits of x fed through one DynamicCache in chunks of the given sizes."""
    cache, out, at = DynamicCache(config=model.config), [], 0
    for n in chunks:
        out.append(model(x[:, at:at + n], cache=cache, use_cache=True).logits)
        at += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("levels,kernel", [(3, 2), (4, 3)])
@pytest.mark.parametrize("decode_kernel", [True, False])
def test_cached_chunks_equal_the_whole_sequence(family, levels, kernel, decode_kernel, monkeypatch):
    """Several tokens per cached step, at every offset against the blocks (both
    decoding paths: hkt_attention_with_kvcache and hkt_attention per token)."""
    monkeypatch.setattr(ht.decoding, "_DECODE_KERNEL", decode_kernel)
    model = scramble(ht.convert(tiny(family), levels=levels, downsample_kernel=kernel))
    x = ids(2, 30)
    with torch.no_grad():  # as in generate: the decoding kernel runs only without gradients
        want = model(x, use_cache=False).logits
        got = _stepwise(model, x, [5, 1, 3, 1, 1, 7, 2, 10])
    assert rel(got, want) < 1e-4


def cached_gradients_match(model, x, chunks):
    """The gradients of every parameter through a cache (x in chunks, each
    attending to the cached ones) are the whole sequence's; returns them."""
    grads = []
    for run in (lambda: model(x, use_cache=False).logits, lambda: _stepwise(model, x, chunks)):
        model.zero_grad()
        run().square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert rel(grads[1][name], g) < 1e-4, name
    return grads[0]


def test_gradients_flow_across_cached_calls():
    """Training through a cache: the gradients of every parameter are the whole sequence's."""
    grads = cached_gradients_match(scramble(ht.convert(tiny("llama"), levels=3)), ids(2, 19), [6, 1, 5, 7])
    assert all(bool(g.abs().sum() > 0) for n, g in grads.items() if ".hkt." in n)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_equals_the_row_alone(family):
    model = scramble(ht.convert(tiny(family), levels=3))
    x = ids(3, 14)
    mask = torch.ones_like(x)
    for row, pad in ((1, 3), (2, 6)):
        x[row, :pad], mask[row, :pad] = 0, 0
    # the positions generate gives padded rows: the coarse maps do not commute with
    # the rotary embedding, so a row's output depends on its positions, not only their differences
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(x, attention_mask=mask, position_ids=positions).logits
    seq, gen_logits = _generate(model, x, attention_mask=mask)
    for row, pad in ((0, 0), (1, 3), (2, 6)):
        alone = x[row:row + 1, pad:]
        assert rel(logits[row, pad:], model(alone).logits[0]) < 1e-4
        seq1, logits1 = _generate(model, alone)
        assert torch.equal(seq[row, 14:], seq1[0, 14 - pad:])
        assert rel(gen_logits[row], logits1[0]) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_right_padding_equals_the_row_alone(family):
    model = scramble(ht.convert(tiny(family), levels=3))
    x = ids(2, 13)
    mask = torch.ones_like(x)
    x[1, 9:], mask[1, 9:] = 0, 0
    logits = model(x, attention_mask=mask).logits
    assert rel(logits[1, :9], model(x[1:, :9]).logits[0]) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_load(family, tmp_path):
    model = scramble(ht.convert(tiny(family), levels=3, downsample_kernel=3, level0_weight=0.7))
    model.save_pretrained(tmp_path)
    loaded = ht.from_pretrained(type(model), str(tmp_path))
    assert loaded.config._attn_implementation == "hkt"
    assert loaded.config.hkt == {"levels": 3, "downsample_kernel": 3, "level0_weight": 0.7}
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    x = ids(2, 9)
    assert torch.equal(model(x).logits, loaded.eval()(x).logits)


def test_from_pretrained_refuses_an_unconverted_checkpoint(tmp_path):
    model = tiny("llama")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="path: .*no 'hkt'"):
        ht.from_pretrained(LlamaForCausalLM, str(tmp_path))


def _beams(model, x, mask, **kw):
    out = model.generate(x, attention_mask=mask, max_new_tokens=10, num_beams=3, num_return_sequences=3,
                         do_sample=False, return_dict_in_generate=True, output_scores=True, **kw)
    return out.sequences, out.beam_indices


def _reordered(order):
    """Whether some returned sequence's path (its beam at each step) moved
    from one beam to another: the cache was reordered on the way."""
    return bool(((order != order[:, :1]) & (order >= 0)).any())


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search(family):
    """levels=1 gives the original's beams token for token; levels=3 the
    same beams with the cache as without it (its coarse levels reordered
    with transformers' cache), on a left-padded batch."""
    base = tiny(family)
    x = ids(2, 9)
    mask = torch.ones_like(x)
    x[1, :3], mask[1, :3] = 0, 0
    want, order = _beams(base, x, mask)
    assert _reordered(order)
    assert torch.equal(_beams(ht.convert(copy.deepcopy(base), levels=1), x, mask)[0], want)
    model = scramble(ht.convert(base, levels=3))
    seq, order = _beams(model, x, mask)
    assert _reordered(order)
    assert torch.equal(seq, _beams(model, x, mask, use_cache=False)[0])


def test_a_changed_cache_is_refused():
    model = scramble(ht.convert(tiny("llama"), levels=3))
    x = ids(1, 10)
    cache = DynamicCache(config=model.config)
    model(x[:, :8], cache=cache, use_cache=True)
    cache.crop(-2)  # what assisted decoding does
    with pytest.raises(NotImplementedError, match="cache that changed"):
        model(x[:, 6:7], cache=cache, use_cache=True)


def test_output_attentions_is_refused():
    model = ht.convert(tiny("llama"), levels=3)
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(ids(1, 5), output_attentions=True)


def test_convert_errors():
    with pytest.raises(ValueError, match="levels"):
        ht.convert(tiny("llama"), levels=0)
    with pytest.raises(ValueError, match="level0_weight"):
        ht.convert(tiny("llama"), level0_weight=1.0)
    model = ht.convert(tiny("llama"))
    with pytest.raises(ValueError, match="already converted"):
        ht.convert(model)
    with pytest.raises(ValueError, match="no attention module"):
        ht.convert(torch.nn.Linear(2, 2))


def test_unconverted_module_is_named():
    model = tiny("llama")
    model.set_attn_implementation("hkt")
    with pytest.raises(RuntimeError, match="convert"):
        model(ids(1, 4))


def test_frozen_attention_stays_frozen():
    model = tiny("llama")
    for layer in model.model.layers:
        layer.self_attn.requires_grad_(False)
    ht.convert(model)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".hkt." in n)


def test_static_cache():
    """levels=1 is the model's attention with any cache; the coarse levels need
    the dynamic one (a static cache's prefill leaves the new tokens' positions
    among empty slots)."""
    x = ids(1, 6)
    one = ht.convert(tiny("llama"), levels=1)
    want = one.generate(x, max_new_tokens=4, do_sample=False)
    assert torch.equal(one.generate(x, max_new_tokens=4, do_sample=False, cache_implementation="static"), want)
    three = ht.convert(tiny("llama"), levels=3)
    with pytest.raises(NotImplementedError, match="static cache"):
        three.generate(x, max_new_tokens=4, do_sample=False, cache_implementation="static")


def test_bfloat16_generation():
    """bfloat16 decodes on hkt_attention one token at a time (the decoding
    kernel takes float32 and float64): the same tokens as without a cache."""
    model = scramble(ht.convert(tiny("qwen2"), levels=3)).to(torch.bfloat16)
    x = ids(2, 9)
    seq, logits = _generate(model, x)
    seq_nc, logits_nc = _generate(model, x, use_cache=False)
    assert torch.equal(seq, seq_nc)
    assert rel(logits.float(), logits_nc.float()) < 2e-2


def test_gradient_checkpointing():
    """transformers' gradient checkpointing recomputes each layer in the
    backward: the same gradients (the attention keeps no state without a cache)."""
    model = scramble(ht.convert(tiny("llama"), levels=3)).train()
    x = ids(2, 15)
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            # the newer name where there is one (transformers 5.25 deprecates the older)
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model.zero_grad()
        model(x, labels=x).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if ".hkt." in n})
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-5, atol=1e-7), name


# per-level windows (convert(windows=...)) shorter than the test sequences (24 tokens)
WINDOWS = [4, 8, None]


def _windows_pair(family, seed=0):
    """The family's tiny model converted with levels=3 and with the same levels
    and WINDOWS, the same trained (scrambled) parameters in both."""
    base = build(family, seed)
    plain = scramble(ht.convert(copy.deepcopy(base), levels=3))
    return plain, scramble(ht.convert(base, levels=3, windows=WINDOWS))


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_windows_compute_the_definition(family, monkeypatch):
    """A padded batch of 24 tokens through every layer with windows equals the
    same model whose attention calls run hkt.reference (the dense definition
    of docs/contract.md section 1.11) instead of the windowed kernels, and
    differs from the conversion without windows."""
    plain, model = _windows_pair(family)
    assert model.config.hkt["windows"] == WINDOWS
    x, mask = padded(family, T=24)
    real = mask.bool()
    with torch.no_grad():
        got = output(model, x, mask)
        assert rel(got[real], output(plain, x, mask)[real]) > 1e-2
        seen = []

        def dense(q, k, v, w, **kw):
            seen.append(kw.get("windows"))
            return hkt.reference.hkt_attention_reference(q, k, v, w, **kw)
        monkeypatch.setattr(hkt, "hkt_attention", dense)
        want = output(model, x, mask)
    assert seen == [tuple(WINDOWS)] * model.config.num_hidden_layers
    assert rel(got[real], want[real]) < 1e-4


def test_windows_left_padding_equals_the_row_alone():
    model = _windows_pair("llama")[1]
    x, mask = padded("llama", T=24)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(x, attention_mask=mask, position_ids=positions).logits
        for row in range(x.shape[0]):
            real = mask[row].bool()
            assert rel(logits[row, real], model(x[row:row + 1, real]).logits[0]) < 1e-4, row


@pytest.mark.parametrize("side", ["right", "left"])
def test_windows_encoder_padding_equals_the_row_alone(side):
    model = _windows_pair("bert")[1]
    x, mask = padded("bert", T=24)
    if side == "left":
        x, mask = x.flip(1), mask.flip(1)
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        got = model(x, attention_mask=mask, position_ids=positions).last_hidden_state
        for row in range(x.shape[0]):
            real = mask[row].bool()
            assert rel(got[row, real], output(model, x[row:row + 1, real])[0]) < 1e-5, row


def test_windows_generate_with_cache_equals_without():
    """Greedy decoding past every window (a left-padded batch of 24, 8 new
    tokens): the same tokens and logits with the cache as without it, and
    several tokens per cached step equal the whole sequence."""
    model = _windows_pair("llama")[1]
    x, mask = padded("llama", T=24)
    out = [model.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, use_cache=c) for c in (True, False)]
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel(torch.stack(out[0].logits, 1), torch.stack(out[1].logits, 1)) < 1e-4
    x = ids(2, 30)
    with torch.no_grad():
        assert rel(_stepwise(model, x, [9, 1, 3, 1, 7, 9]), model(x, use_cache=False).logits) < 1e-4


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_windows_train_every_added_parameter(family):
    _trains_every_added_parameter(family, build(family), windows=WINDOWS)


def test_windows_save_and_load(tmp_path):
    model = _windows_pair("llama")[1]
    model.save_pretrained(tmp_path)
    loaded = ht.from_pretrained(type(model), str(tmp_path)).eval()
    assert loaded.config.hkt == {"levels": 3, "downsample_kernel": 2, "level0_weight": 0.5, "windows": WINDOWS}
    assert all(m.windows == tuple(WINDOWS) for m in loaded.modules() if isinstance(m, ht.HKTLevels))
    x, mask = padded("llama", T=24)
    with torch.no_grad():
        assert torch.equal(output(model, x, mask), output(loaded, x, mask))


def test_windows_errors():
    """Bad windows are refused at convert, by name, with nothing half converted."""
    cases = [(dict(windows=[0, 8, None]), ValueError, r"windows\[0\]: expected None or a positive multiple"),
             (dict(windows=[4, 8, 6]), ValueError, r"windows\[2\]: expected None or a positive multiple of 4"),
             (dict(windows=[8, 8, None]), ValueError, r"windows\[1\]: the kernels need each window larger"),
             (dict(windows=[4, None]), ValueError, "windows: expected one entry per level, 3, got 2"),
             (dict(windows=8), TypeError, "windows: expected None or a list"),
             (dict(levels=1, windows=[4]), ValueError, "windows: needs levels >= 2")]
    for options, error, message in cases:
        model = build("llama")
        with pytest.raises(error, match=message):
            ht.convert(model, **dict(dict(levels=3), **options))
        assert not any(isinstance(m, ht.HKTLevels) for m in model.modules())
    model = windowed("mistral")
    with pytest.raises(ValueError, match="windows: MistralAttention .* sliding window of its own"):
        ht.convert(model, levels=3, windows=WINDOWS)
    assert not any(isinstance(m, ht.HKTLevels) for m in model.modules())


@pytest.mark.parametrize("levels", [1, 3])
def test_level_weights_are_convex_and_the_op_gets_them_scaled(levels):
    model = scramble(ht.convert(tiny("llama"), levels=levels))
    layers = [m for m in model.modules() if isinstance(m, ht.HKTLevels)]
    assert layers
    for m in layers:
        w = m.level_weights()
        assert w.shape == (m.num_heads, levels) and (w >= 0).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(m.num_heads))
        torch.testing.assert_close(m.scaled_level_weights(), w * m.level_scale)
        if levels > 1:  # level 0's weight at conversion times its scale: the model's own score
            assert (m.level_scale > 1).all()


def _steps_from(model, x, mask, new, keep_tails):
    """Logits of greedy-free decoding: prompt x (mask its padding), then the
    tokens ``new`` one at a time through one cache; with ``keep_tails`` False
    every layer forgets its tails after the prompt, so each step downsamples
    a window of recent positions instead.  Returns (logits, whether every
    layer's last step ran from its tails)."""
    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        model(x, attention_mask=mask, cache=cache, use_cache=True)
        states = [m for m in model.modules() if isinstance(m, ht.HKTLevels)]
        if not keep_tails:
            for m in states:
                m.decode_state.tails = None
        for i in range(new.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out.append(model(new[:, i:i + 1], attention_mask=mask, cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1), all(m.decode_state.tails is not None for m in states)


@pytest.mark.parametrize("windows", [None, WINDOWS])
@pytest.mark.parametrize("levels,kernel", [(3, 2), (4, 3)])
def test_one_token_steps_from_the_tails(windows, levels, kernel):
    """A one-token step makes only the blocks its token begins, from the
    levels' latest inputs the state keeps (hkt.decoding.tails): in float64,
    over a left-padded batch whose rows begin blocks at different steps, the
    same logits to the last bit as steps that downsample a window of recent
    positions, and the whole sequence's without a cache."""
    windows = None if windows is None else (windows + [None])[:levels]
    model = scramble(ht.convert(tiny("llama"), levels=levels, downsample_kernel=kernel, windows=windows)).double()
    x, mask = padded("llama", T=19)
    new = ids(3, 21, seed=5)
    fast, ran = _steps_from(model, x, mask, new, keep_tails=True)
    slow, ran_slow = _steps_from(model, x, mask, new, keep_tails=False)
    assert ran and not ran_slow
    assert torch.equal(fast, slow)
    with torch.no_grad():
        whole = model(torch.cat([x, new], 1), attention_mask=torch.cat([mask, torch.ones_like(new)], 1)).logits
    assert rel(fast, whole[:, x.shape[1]:]) < 1e-12


def test_one_level_step_keeps_the_keys_gradients():
    """levels=1, one query against keys that want gradients (a trainable
    encoder under a frozen decoder's cross-attention): not the decoding
    kernel, which has no backward; the keys and values get their gradients."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 8, generator=g)
    k, v = (torch.randn(1, 2, 5, 8, generator=g, requires_grad=True) for _ in range(2))
    out = ht.attention._level0(q, k, v, torch.ones(4, 1), None, None, 0.0, True)
    out.square().sum().backward()
    assert bool(k.grad.abs().sum() > 0) and bool(v.grad.abs().sum() > 0)


def test_one_level_band_only_where_the_mask_hides_both_sides():
    """levels=1: a causal layer's window goes to the kernels as their band
    only where the mask hides every key the band would (a custom mask that
    shows a key after its query keeps it)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64, generator=g) for _ in range(3))
    w = torch.ones(2, 1, dtype=torch.float64)
    pos = torch.arange(6)
    mask = ((pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 2))
    mask[0, 5] = True  # a key after its query, further than the window
    got = ht.attention._level0(q, k, v, w, mask[None, None], None, 0.0, True, window=2)
    want = hkt.reference.hkt_attention_reference([q], [k], v, w, attn_mask=mask[None, None])
    assert torch.allclose(got, want, atol=1e-12)
