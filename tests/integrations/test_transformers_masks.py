"""Converted models on every mask transformers builds beyond left and right
padding: a row whose tokens are not one run (a pad token inside a prompt:
"holes"), packed sequences (position_ids that restart, or a 4-D
block-diagonal mask), and a refusal by name of any other mask with
levels > 1.  With holes a row computes, at its tokens, what the row without
them computes (its coarse blocks are formed from its tokens only); packed
sequences each what the sequence alone computes."""
import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed (pip install 'hkt[transformers]')")
from transformers import DynamicCache  # noqa: E402

import hkt  # noqa: E402
import hkt.integrations.transformers as ht  # noqa: E402
from test_transformers import MATRIX, WINDOWED, _beams, build, ids, output, rel, scramble, windowed  # noqa: E402

WINDOWS = [4, 8, None]  # convert(windows=...), shorter than the test rows
T = 16
# (row, first, end): the holes of the test batch's rows, one row without any
HOLES = [(0, 5, 7), (0, 11, 12), (2, 0, 2), (2, 8, 11)]


def holed(B=3, n=T, holes=HOLES, pad=0):
    """Tokens and 2-D mask of a batch whose rows have padding inside (pad
    tokens ``pad``), and the positions generate would give them."""
    x, mask = ids(B, n), torch.ones(B, n, dtype=torch.long)
    for row, a, b in holes:
        x[row, a:b], mask[row, a:b] = pad, 0
    return x, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def to_the_left(x, mask):
    """The same rows with their padding moved before their tokens (left padding)."""
    order = torch.sort(mask, dim=1, stable=True).indices  # padding first, each part in order
    return x.gather(1, order), mask.gather(1, order)


def equals_the_rows_alone(model, x, mask, got, tol):
    for row in range(x.shape[0]):
        real = mask[row].bool()
        assert rel(got[row, real], output(model, x[row:row + 1, real])[0]) < tol, row


@pytest.mark.parametrize("family", MATRIX)
@pytest.mark.parametrize("levels,tol", [(1, 2e-5), (3, 2e-4)])
def test_family_converts_exactly_with_holes(family, levels, tol):
    """Every family of the matrix, rows with padding inside them: levels=1
    (the model's attention with its own mask) and levels=3 at conversion
    compute the original's outputs at every token (the holes checked to
    change them)."""
    base = build(family)
    x, mask, _ = holed(pad=MATRIX[family][2].get("pad_token_id", 0))
    real = mask.bool()
    with torch.no_grad():
        want = output(base, x, mask)
        assert rel(output(base, x)[real], want[real]) > 1e-2
        assert rel(output(ht.convert(copy.deepcopy(base), levels=levels), x, mask)[real], want[real]) <= tol


def packed(n=T):
    """position_ids of two rows of packed sequences (5 + 4 + 7, 9 + 7 tokens)
    and each sequence's (row, first, end)."""
    spans = [(0, 0, 5), (0, 5, 9), (0, 9, n), (1, 0, 9), (1, 9, n)]
    positions = torch.zeros(2, n, dtype=torch.long)
    for row, a, b in spans:
        positions[row, a:b] = torch.arange(b - a)
    return positions, spans


def block_diagonal(spans, B=2, n=T, window=None):
    """The 4-D causal mask (B, 1, n, n) that keeps each sequence to itself
    (with a sliding ``window``: within it)."""
    mask = torch.zeros(B, 1, n, n, dtype=torch.bool)
    for row, a, b in spans:
        mask[row, 0, a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril(0).triu(1 - (window or n))
    return mask


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_one_level_computes_the_original_on_packed_sequences(family):
    """position_ids that restart: transformers (use_cache=False, no 2-D mask)
    builds the block-diagonal mask for every attention implementation; a
    4-D one handed in is passed on as it is."""
    base = windowed(family) if family == "mistral" else build(family)
    positions, spans = packed()
    x = ids(2, T)
    model = ht.convert(copy.deepcopy(base), levels=1)
    with torch.no_grad():
        want = base(x, position_ids=positions, use_cache=False).logits
        assert rel(base(x, use_cache=False).logits, want) > 1e-2  # the packing matters
        assert rel(model(x, position_ids=positions, use_cache=False).logits, want) <= 2e-5
        four_d = block_diagonal(spans)
        want = base(x, attention_mask=four_d, position_ids=positions, use_cache=False).logits
        assert rel(model(x, attention_mask=four_d, position_ids=positions, use_cache=False).logits, want) <= 2e-5


@pytest.mark.parametrize("windows", [None, WINDOWS])
@pytest.mark.parametrize("family", ["llama", "qwen2", "bert"])
def test_holes_equal_the_row_without_them(family, windows):
    """levels=3 with trained levels, float64: at its tokens a row with holes
    computes what the row with the holes removed computes, with the
    positions generate gives it (an encoder: bidirectional over its
    tokens); a row of padding only gives no NaN."""
    model = scramble(ht.convert(build(family), levels=3, windows=windows)).double()
    x, mask, positions = holed()
    x, mask, positions = torch.cat([x, x[:1]]), torch.cat([mask, 0 * mask[:1]]), torch.cat([positions, positions[:1]])
    with torch.no_grad():
        got = model(x, attention_mask=mask, position_ids=positions)
        got = got.logits if hasattr(got, "logits") else got.last_hidden_state
        assert bool(got.isfinite().all())
        equals_the_rows_alone(model, x[:3], mask[:3], got, 1e-10)
        # the holes matter: the same row read as one run of tokens computes something else
        assert rel(got[0, mask[0].bool()], output(model, x[:1])[0, mask[0].bool()]) > 1e-2


@pytest.mark.parametrize("windows", [None, WINDOWS])
def test_holes_give_padding_rows_zeros_and_gradients(windows):
    """The attention function itself (what transformers calls), on a layer
    with trained levels and the mask transformers builds: padding queries
    get zeros, a row's tokens what the row's tokens alone get, and the
    backward runs to every input and HKT parameter with finite gradients."""
    model = scramble(ht.convert(build("llama"), levels=3, windows=windows)).double()
    module = model.model.layers[0].self_attn
    H, H_kv, D = 4, 2, 8
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, h, T, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, H_kv, H_kv))
    _, mask, _ = holed()
    real = mask.bool()
    four_d = (torch.ones(T, T, dtype=torch.bool).tril() & real[:, None, :])[:, None]
    out, _ = ht.hkt_attention_forward(module, q, k, v, four_d)
    assert out.shape == (3, T, H, D)
    assert bool((out[~real] == 0).all())
    for row in range(3):
        tokens = real[row]
        alone, _ = ht.hkt_attention_forward(module, q[row:row + 1, :, tokens], k[row:row + 1, :, tokens],
                                            v[row:row + 1, :, tokens], None)
        assert rel(out[row, tokens], alone[0]) < 1e-10, row
    out.square().sum().backward()
    for grad in [q.grad, k.grad, v.grad] + [p.grad for p in module.hkt.parameters()]:
        assert grad is not None and bool(grad.isfinite().all()) and bool(grad.abs().sum() > 0)


def _greedy(model, x, mask, **kw):
    out = model.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("windows,decode_kernel", [(None, True), (None, False), (WINDOWS, True)])
def test_generate_with_an_eos_inside_the_prompt(windows, decode_kernel, monkeypatch):
    """pad_token_id = eos (as many models pad), an eos inside the prompt that
    the mask hides: levels=1 gives the original's tokens; levels=3 (trained)
    those of the same prompt with its padding moved to the left, with the
    cache as without it (every decoding path)."""
    monkeypatch.setattr(ht.decoding, "_DECODE_KERNEL", decode_kernel)
    base = build("llama", pad_token_id=2)
    x, mask, _ = holed(pad=2)
    want, _ = _greedy(base, x, mask)
    assert torch.equal(_greedy(ht.convert(copy.deepcopy(base), levels=1), x, mask)[0], want)
    model = scramble(ht.convert(base, levels=3, windows=windows))
    seq, logits = _greedy(model, x, mask)
    left, left_mask = to_the_left(x, mask)
    seq_left, logits_left = _greedy(model, left, left_mask)
    assert torch.equal(seq[:, T:], seq_left[:, T:])
    assert rel(logits, logits_left) < 1e-4
    assert torch.equal(_greedy(model, x, mask, use_cache=False)[0], seq)


def test_generate_infers_holes_from_the_pad_token():
    """pad_token_id other than eos: generate reads the mask from the prompt,
    holes included (no attention_mask given)."""
    model = scramble(ht.convert(build("llama"), levels=3))
    x, mask, _ = holed()
    seq, logits = _greedy(model, x, None)
    assert torch.equal(seq, _greedy(model, x, mask)[0])
    left, left_mask = to_the_left(x, mask)
    assert torch.equal(seq[:, T:], _greedy(model, left, left_mask)[0][:, T:])


@pytest.mark.parametrize("windows", [None, WINDOWS])
def test_beam_search_with_holes(windows):
    """num_beams=3 after a prompt with holes (the layout reordered with the
    cache): levels=1 the original's beams, levels=3 the beams of the prompt
    with its padding on the left, and the same without the cache."""
    base = build("llama", pad_token_id=2)
    x, mask, _ = holed(B=2, holes=[(0, 3, 5), (1, 6, 7)], pad=2)
    want = _beams(base, x, mask)[0]
    assert torch.equal(_beams(ht.convert(copy.deepcopy(base), levels=1), x, mask)[0], want)
    model = scramble(ht.convert(base, levels=3, windows=windows))
    seq = _beams(model, x, mask)[0]
    left, left_mask = to_the_left(x, mask)
    assert torch.equal(seq[:, T:], _beams(model, left, left_mask)[0][:, T:])
    assert torch.equal(seq, _beams(model, x, mask, use_cache=False)[0])


def mistral():
    """Mistral with a sliding window of 8, checked to matter on the test rows."""
    model = build("mistral", sliding_window=8)
    x = ids(2, T)
    with torch.no_grad():
        assert rel(build("mistral")(x).logits, model(x).logits) > 1e-2
    return model


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_window_with_holes_converts_exactly(family):
    """The matrix's sliding-window families (a window of 4 in the model's
    positions, some layers local), holes wider than it: levels=1 and levels=3
    at conversion compute the original's logits."""
    base = windowed(family)
    x, mask, _ = holed(holes=HOLES + [(1, 2, 11)])
    real = mask.bool()
    with torch.no_grad():
        want = base(x, attention_mask=mask).logits
        for levels, tol in ((1, 2e-5), (3, 2e-4)):
            got = ht.convert(copy.deepcopy(base), levels=levels)(x, attention_mask=mask).logits
            assert rel(got[real], want[real]) <= tol, levels


def test_sliding_window_with_holes_is_the_dense_definition():
    """A Mistral layer (window 8) with trained levels, float64, rows with
    holes: each row's tokens get hkt.reference's HKT over the row's tokens
    alone, the window's mask built from their positions in the model."""
    model = scramble(ht.convert(mistral(), levels=3)).double()
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(3, h, T, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    _, mask, _ = holed(holes=HOLES + [(1, 2, 11)])
    real = mask.bool()
    i = torch.arange(T)
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 8)
    with torch.no_grad():
        out, _ = ht.hkt_attention_forward(module, q, k, v, (band & real[:, None, :])[:, None], sliding_window=8)
        w = module.hkt.scaled_level_weights()
        for row in range(3):
            at = i[real[row]]  # the tokens' positions in the model
            qr, kr, vr = (x[row:row + 1, :, at] for x in (q, k, v))
            want = hkt.reference.hkt_attention_reference(
                [qr] + module.hkt.coarse_heads(qr, "q"), [kr] + module.hkt.coarse_heads(kr, "k"), vr, w,
                attn_mask=band[at][:, at], is_causal=True)
            assert rel(out[row, at], want[0].transpose(0, 1)) < 1e-10, row
        assert bool((out[~real] == 0).all())


def test_sliding_window_with_holes_generates():
    """Greedy decoding past the window after a prompt with holes: levels=1
    the original's tokens, levels=3 (trained) the same with the cache as
    without (each step's window in the model's positions)."""
    base = mistral()
    x, mask, _ = holed()
    want, _ = _greedy(base, x, mask)
    assert torch.equal(_greedy(ht.convert(copy.deepcopy(base), levels=1), x, mask)[0], want)
    assert torch.equal(_greedy(ht.convert(copy.deepcopy(base), levels=3), x, mask)[0], want)
    model = scramble(ht.convert(base, levels=3))
    (seq, logits), (seq_nc, logits_nc) = _greedy(model, x, mask), _greedy(model, x, mask, use_cache=False)
    assert torch.equal(seq, seq_nc)
    assert rel(logits, logits_nc) < 1e-4


@pytest.mark.parametrize("family,windows", [("llama", None), ("llama", WINDOWS), ("mistral", None)])
def test_packed_sequences_equal_each_alone(family, windows):
    """levels=3 with trained levels: packed sequences (position_ids that
    restart, and the same as a 4-D mask) each compute what the sequence alone
    computes (Mistral: with its sliding window of 8)."""
    base = mistral() if family == "mistral" else build(family)
    model = scramble(ht.convert(base, levels=3, windows=windows)).double()
    positions, spans = packed()
    x = ids(2, T)
    with torch.no_grad():
        for got in (model(x, position_ids=positions, use_cache=False).logits,
                    model(x, attention_mask=block_diagonal(spans, window=getattr(base.config, "sliding_window", None)),
                          position_ids=positions).logits):
            for row, a, b in spans:
                assert rel(got[row, a:b], model(x[row:row + 1, a:b]).logits[0]) < 1e-10, (row, a)


def test_decoding_after_packed_sequences_is_refused():
    model = scramble(ht.convert(build("llama"), levels=3))
    positions, spans = packed()
    x = ids(2, T + 1)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :T], attention_mask=block_diagonal(spans), position_ids=positions, cache=cache, use_cache=True)
        with pytest.raises(NotImplementedError, match="decoding after packed sequences.*each sequence on its own.*"
                                                      "levels=1"):
            model(x[:, T:], cache=cache, use_cache=True)


def test_other_masks_are_refused_by_name():
    """A 4-D mask of another form (a prefix the queries see whole, as
    bidirectional image blocks are) at levels=3: refused at the first call,
    naming where it differs and what to do; levels=1 computes it."""
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    mask[:4, :4] = True  # the first 4 tokens see each other
    mask = mask[None, None].expand(2, 1, T, T)
    x = ids(2, T)
    model = ht.convert(build("llama"), levels=3)
    with pytest.raises(NotImplementedError, match=r"attention mask other than causal attention over each row's "
                                                  r"tokens or over each of its packed sequences \(found: row 0's "
                                                  r"query at position 0 sees the key at position 1.*convert with "
                                                  r"levels=1"):
        model(x, attention_mask=mask, use_cache=False)
    base = build("llama")
    with torch.no_grad():
        want = base(x, attention_mask=mask, use_cache=False).logits
        got = ht.convert(copy.deepcopy(base), levels=1)(x, attention_mask=mask, use_cache=False).logits
    assert rel(got, want) <= 2e-5


def test_chunked_attention_is_refused_by_name():
    """Llama 4's chunked_attention layers (chunks of 8 positions) look like
    packed sequences past a chunk: levels=3 refuses them there by name,
    levels=1 computes the original's logits."""
    config = transformers.Llama4TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_chunk_size=8, num_local_experts=2,
        no_rope_layers=[1, 0], max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert config.layer_types == ["chunked_attention", "full_attention"]
    torch.manual_seed(0)
    base = transformers.Llama4ForCausalLM(config).eval()
    x = ids(2, T)
    with torch.no_grad():
        want = base(x).logits
        assert rel(ht.convert(copy.deepcopy(base), levels=1)(x).logits, want) <= 2e-5
        model = ht.convert(base, levels=3)
        model(x[:, :8])  # within one chunk: causal attention
        with pytest.raises(NotImplementedError, match="chunked attention .*chunks of 8 positions.*convert with "
                                                      "levels=1"):
            model(x)


@pytest.mark.parametrize("holes", [[(1, 12, T)], [(1, 3, 5), (1, 12, T)]])
def test_generate_after_right_padding_is_refused(holes):
    """A prompt whose row ends in padding (with holes before it, or not):
    the original's next token comes from a padding position's output, which
    hkt makes zero, so the first step is refused, saying to pad on the left."""
    model = scramble(ht.convert(build("llama"), levels=3))
    x, mask, _ = holed(holes=holes)
    with pytest.raises(NotImplementedError, match="right padding.*pad on the left"):
        model.generate(x, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_packed_sequences_in_an_encoder():
    """BERT with a 4-D mask that keeps packed sequences apart (bidirectional
    within each): each sequence's states are those of the sequence alone."""
    model = scramble(ht.convert(build("bert"), levels=3)).double()
    positions, spans = packed()
    mask = torch.zeros(2, 1, T, T, dtype=torch.bool)
    for row, a, b in spans:
        mask[row, 0, a:b, a:b] = True
    x = ids(2, T)
    with torch.no_grad():
        got = model(x, attention_mask=mask, position_ids=positions).last_hidden_state
        for row, a, b in spans:
            assert rel(got[row, a:b], output(model, x[row:row + 1, a:b])[0]) < 1e-10, (row, a)


def test_packed_sequences_train_every_added_parameter():
    model = scramble(ht.convert(build("llama"), levels=3)).train()
    positions, _ = packed()
    model(ids(2, T), position_ids=positions, labels=ids(2, T), use_cache=False).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if ".hkt." in n]
    assert len(grads) == 5 * model.config.num_hidden_layers
    assert all(g is not None and bool(g.isfinite().all()) and bool(g.abs().sum() > 0) for g in grads)
