"""Generation with the cache of models converted with per-level windows
(convert(windows=...)): on the CPU in float32/float64 without gradients each
cached step runs the windowed decoding kernel over the rings its layer filled
at the prompt (hkt.decoding.level_cache.LevelStore); elsewhere it recomputes the
windowed op over the whole sequence.  Either way the tokens are those of
generation without the cache."""
import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'hkt[transformers]')")
from transformers import DynamicCache  # noqa: E402

import hkt  # noqa: E402
import hkt.decoding.windowed as window_decode  # noqa: E402
import hkt.integrations.transformers as ht  # noqa: E402
from test_transformers import (_beams, _reordered, _stepwise, build, cached_gradients_match, ids,  # noqa: E402
                               padded, rel, scramble)

# windows shorter than the prompts (24 tokens): every level windowed, and a global top level
RING_WINDOWS = [[2, 4, 8], [4, 8, None]]


def _model(windows, family="llama"):
    return scramble(ht.convert(build(family), levels=3, windows=windows))


def _states(model):
    return [m.decode_state for m in model.modules() if isinstance(m, ht.HKTLevels)]


class _Spy:
    """Counts the calls of the windowed op over whole sequences (hkt_attention)
    and of the windowed decoding kernel."""

    def __init__(self, monkeypatch):
        self.attention = self.kernel = 0
        attention, kernel = hkt.hkt_attention, window_decode.window_decode_kernel

        def count_attention(*args, **kwargs):
            self.attention += 1
            return attention(*args, **kwargs)

        def count_kernel(*args, **kwargs):
            self.kernel += 1
            return kernel(*args, **kwargs)
        monkeypatch.setattr(hkt, "hkt_attention", count_attention)
        monkeypatch.setattr(window_decode, "window_decode_kernel", count_kernel)


def _generate(model, x, mask, n=24, **kw):
    out = model.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("windows,left_padded", [(RING_WINDOWS[0], True), (RING_WINDOWS[1], True),
                                                  (RING_WINDOWS[0], False)])
def test_ring_generate_equals_without_cache(windows, left_padded, monkeypatch):
    """Greedy decoding of a batch 24 tokens past the prompt: the same tokens
    and logits with the cache as without it, each cached step on the ring
    kernel (hkt_attention runs at the prompt only, once a layer), with rings
    whose size does not grow with the sequence.  Each step makes the blocks
    its token begins from the layer's tails (HeadLevelCache.step_levels),
    never from a window of recent positions (_new_blocks)."""
    model = _model(windows)
    layers = model.config.num_hidden_layers
    x, mask = padded("llama", T=24) if left_padded else (ids(2, 24), None)
    want, want_logits = _generate(model, x, mask, use_cache=False)
    spy = _Spy(monkeypatch)
    new_blocks, step_levels = ht.HKTLevels._new_blocks, ht.decoding.HeadLevelCache.step_levels
    calls, steps = [], []
    monkeypatch.setattr(ht.HKTLevels, "_new_blocks", lambda *a: calls.append(1) or new_blocks(*a))
    monkeypatch.setattr(ht.decoding.HeadLevelCache, "step_levels", lambda *a: steps.append(1) or step_levels(*a))
    got, logits = _generate(model, x, mask)
    assert torch.equal(got, want)
    assert rel(logits, want_logits) < 1e-4
    assert spy.attention == layers
    # one call per row and step where the rows of the left-padded batch are at different positions
    assert spy.kernel == 23 * layers * (x.shape[0] if left_padded else 1)
    assert len(steps) == 23 * layers and not calls
    sizes = [[k.shape for k, W in zip(s.store.k, windows) if W is not None] for s in _states(model)]
    _generate(model, x, mask, n=40)
    assert sizes == [[k.shape for k, W in zip(s.store.k, windows) if W is not None] for s in _states(model)]


@pytest.mark.parametrize("windows", RING_WINDOWS)
def test_ring_chunks_equal_the_whole_sequence(windows, monkeypatch):
    """A sequence fed through the cache in chunks (longer than level 0's
    window: the kernel's rounds) equals the whole sequence, in float64 too."""
    for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-10)):
        model = _model(windows).to(dtype)
        x = ids(2, 30)
        with torch.no_grad():
            want = model(x, use_cache=False).logits
            spy = _Spy(monkeypatch)
            got = _stepwise(model, x, [9, 1, 3, 1, 7, 9])
        assert spy.attention == model.config.num_hidden_layers and spy.kernel > 0
        assert rel(got, want) < tol
        monkeypatch.undo()


@pytest.mark.parametrize("family,pad", [("llama", 3), ("qwen2", 0), ("llama", 0)])
def test_ring_beam_search(family, pad):
    """num_beams=3 with the cache gives the beams without it: every layer's
    rings, and the coarse queries the steps at odd positions reuse (rows
    without padding), are reordered with transformers' cache (and the paths
    do move between beams)."""
    model = _model([2, 4, 8], family)
    x = ids(2, 20)
    mask = torch.ones_like(x)
    x[1, :pad], mask[1, :pad] = 0, 0
    seq, order = _beams(model, x, mask)
    assert _reordered(order)
    assert torch.equal(seq, _beams(model, x, mask, use_cache=False)[0])


def test_fallbacks_recompute(monkeypatch):
    """bfloat16, the decoding kernels turned off, and a prompt run with
    gradients keep every query, and the steps recompute the windowed op:
    the same tokens as without the cache, the kernel never called."""
    model = _model([2, 4, 8])
    x, mask = padded("llama", T=24)
    want = _generate(model, x, mask, n=8, use_cache=False)[0]
    with monkeypatch.context() as m:
        m.setattr(ht.decoding, "_DECODE_KERNEL", False)
        spy = _Spy(m)
        assert torch.equal(_generate(model, x, mask, n=8)[0], want)
        assert spy.kernel == 0 and all(s.store is None for s in _states(model))
    low = copy.deepcopy(model).to(torch.bfloat16)
    assert torch.equal(_generate(low, x, mask, n=8)[0], _generate(low, x, mask, n=8, use_cache=False)[0])
    assert all(s.store is None for s in _states(low))
    # training through the cache: gradients reach the prompt's queries across the steps
    cached_gradients_match(model.train(), ids(2, 19), [6, 1, 5, 7])


def test_a_grad_step_after_a_ring_prompt_is_refused():
    model = _model([2, 4, 8])
    x = ids(1, 12)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :10], cache=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="same grad mode"):
        model(x[:, 10:11], cache=cache, use_cache=True)


def test_a_changed_cache_is_refused():
    """Cropping (assisted decoding) and a static cache stay refused with
    windows, each error saying why and what to do instead."""
    model = _model([2, 4, 8])
    x = ids(1, 12)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :10], cache=cache, use_cache=True)
        cache.crop(-2)
        with pytest.raises(NotImplementedError, match="cropping.*without an assistant model"):
            model(x[:, 8:9], cache=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="static cache.*unfilled.*dynamic cache"):
        model.generate(x, max_new_tokens=4, do_sample=False, cache_implementation="static")


def test_ring_generate_takes_gemma2_soft_cap(monkeypatch):
    """A soft-capped model (Gemma 2's attn_logit_softcapping, small enough to
    change its logits) converted with windows: the ring steps cap their scores
    as the prompt's windowed op does, so the cache gives the tokens and logits
    generation without it gives."""
    x = ids(2, 24)
    capped = _model(RING_WINDOWS[1], family="gemma2")
    for m in capped.modules():
        if hasattr(m, "attn_logit_softcapping"):
            m.attn_logit_softcapping = 0.5
    uncapped = copy.deepcopy(capped)
    for m in uncapped.modules():
        if hasattr(m, "attn_logit_softcapping"):
            m.attn_logit_softcapping = None
    assert rel(capped(x).logits, uncapped(x).logits) > 1e-3  # the cap matters here
    want, want_logits = _generate(capped, x, None, n=16, use_cache=False)
    spy = _Spy(monkeypatch)
    got, logits = _generate(capped, x, None, n=16)
    assert torch.equal(got, want)
    assert rel(logits, want_logits) < 1e-4
    assert spy.kernel > 0
