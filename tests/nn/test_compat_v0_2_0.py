"""Files saved by hkt 0.2.0 (tests/data/v0_2_0/, written by make_files.py there
with that version) load into today's code and compute what 0.2.0 computed:
two MultiheadHKT state_dicts (one with windows, grouped kv heads and
batch_first; one without, K = 3 taps) -- forward, attention weights, the
gradients of the input and of every parameter, and decoding -- and a converted
tiny Llama model saved with save_pretrained -- its logits on a left-padded
batch and what generate makes of it.

float64 modules to 1e-12 and the float32 model to 1e-5 rather than bitwise: the
files were written on one machine, and another instruction set may round
differently (the restructures that must keep the bits are compared bitwise on
one machine by tools/compare_builds.py)."""
import json
import os

import pytest
import torch

safetensors = pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'hkt[transformers]')")
from safetensors import safe_open  # noqa: E402

import hkt  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "v0_2_0")
F64 = torch.float64


def _load(name):
    with safe_open(os.path.join(DATA, name), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _close(got, want, tol):
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["mha_windows", "mha_plain"])
def test_multihead_state_dict_of_0_2_0(name):
    saved, meta = _load(name + ".safetensors")
    assert meta["hkt"] == "0.2.0"
    kwargs = json.loads(meta["kwargs"])
    m = hkt.MultiheadHKT(**kwargs, dtype=F64)
    state = {k[len("state."):]: v for k, v in saved.items() if k.startswith("state.")}
    m.load_state_dict(state, strict=True)
    assert set(m.state_dict()) == set(state)  # the same names, none added or lost

    x = saved["x"].clone().requires_grad_(True)
    out, weights = m(x, x, x, is_causal=True, need_weights=True, average_attn_weights=False)
    _close(out, saved["out"], 1e-12)
    _close(weights, saved["weights"], 1e-12)
    out.pow(2).sum().backward()
    _close(x.grad, saved["x_grad"], 1e-12)
    for n, p in m.named_parameters():
        _close(p.grad, saved["grad." + n], 1e-12)

    m.eval()
    T = x.shape[1] if m.batch_first else x.shape[0]
    with torch.no_grad():
        cache = m.init_cache(x.shape[0] if m.batch_first else x.shape[1], 32)
        xs = x.detach()
        part = (lambda a, b: xs[:, a:b]) if m.batch_first else (lambda a, b: xs[a:b])
        steps = [m.decode(part(0, 5), cache)] + [m.decode(part(t, t + 1), cache) for t in range(5, T)]
    _close(torch.cat(steps, dim=1 if m.batch_first else 0), saved["decoded"], 1e-12)


def test_converted_llama_of_0_2_0():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'hkt[transformers]')")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaForCausalLM

    import hkt.integrations.transformers as ht
    saved, meta = _load("llama_levels3_outputs.safetensors")
    assert meta["hkt"] == "0.2.0"
    model = ht.from_pretrained(LlamaForCausalLM, os.path.join(DATA, "llama_levels3")).eval()
    assert model.config.hkt == {"levels": 3, "downsample_kernel": 2, "level0_weight": 0.5}
    ids, mask = saved["ids"], saved["mask"]
    with torch.no_grad():
        _close(model(ids, attention_mask=mask).logits, saved["logits"], 1e-5)
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    assert torch.equal(gen.sequences, saved["sequences"])
    _close(torch.stack(gen.logits, dim=1), saved["gen_logits"], 1e-5)
