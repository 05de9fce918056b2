"""One route to each kernel family (hkt/ops/route.py): every public entry of a
family reaches its route, which picks the op, the eager autograd or the
direct kernel call; nothing else calls the family's kernels, autograd
Functions or ops."""
import ast
import pathlib

import pytest
import torch

import hkt
from hkt.downsample import causal_downsample
from hkt.ops import route
from helpers import level_len, sample_inputs

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Reached(Exception):
    pass


def _blocked(monkeypatch, name):
    def stop(*args, **kwargs):
        raise Reached(name)
    monkeypatch.setattr(route, name, stop)


def _module(**kw):
    torch.manual_seed(0)
    return hkt.MultiheadHKT(16, 2, batch_first=True, levels=2, **kw).double()


def _x(T=6):
    torch.manual_seed(1)
    return torch.randn(2, T, 16, dtype=torch.float64)


def _dense_entries():
    q, k, v, w = sample_inputs(1, 2, 5, 5, 4, 4, 2)
    x = _x()

    def functional(grad, mask=None):
        qs, ks = [t.clone().requires_grad_(grad) for t in q], [t.clone() for t in k]
        return lambda: hkt.hkt_attention(qs, ks, v, w, attn_mask=mask, is_causal=True)

    meta = [t.to("meta") for t in q], [t.to("meta") for t in k], v.to("meta"), w.to("meta")
    return {
        "eager, no gradient": functional(False),
        "eager, gradient": functional(True),
        "eager, mask": functional(False, torch.ones(5, 5, dtype=torch.bool)),
        "meta tensors": lambda: hkt.hkt_attention(*meta),
        "module, packed projection (gradient)": lambda: _module(num_kv_heads=1)(x, x, x, need_weights=False),
        "module, no gradient": lambda: _no_grad(lambda: _module()(x, x, x, need_weights=False)),
        "module, cross-attention": lambda: _module()(x, _x(4), _x(4), need_weights=False),
    }


def _no_grad(fn):
    with torch.no_grad():
        return fn()


@pytest.mark.parametrize("entry", list(_dense_entries()))
def test_every_dense_entry_takes_the_dense_route(monkeypatch, entry):
    call = _dense_entries()[entry]
    call()  # runs as it is
    _blocked(monkeypatch, "attention")
    with pytest.raises(Reached):
        call()


def test_the_scripted_module_takes_the_dense_route_s_torchscript_branch():
    # TorchScript cannot call route.attention: its branch is route.scripted_attention,
    # which the module calls, and which computes what the route does
    assert hkt.nn.modules.scripted_attention is route.scripted_attention
    q, k, v, w = sample_inputs(1, 2, 7, 7, 4, 3, 2)
    mask = torch.rand(1, 1, 7, 7) > 0.3
    want = hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=True)
    got = route.scripted_attention(q, k, v, w, mask, True, 0.0)
    assert torch.equal(got, want)


def _varlen_inputs(grad=False):
    torch.manual_seed(2)
    lens, L, H, D = [3, 5], 2, 2, 4
    rows = [sum(level_len(n, l) for n in lens) for l in range(L)]
    q = [torch.randn(r, H, D, dtype=torch.float64, requires_grad=grad) for r in rows]
    k = [torch.randn(r, H, D, dtype=torch.float64) for r in rows]
    v = torch.randn(rows[0], H, D, dtype=torch.float64)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    return q, k, v, torch.tensor([0.7, 0.3], dtype=torch.float64), cu, cu


@pytest.mark.parametrize("entry", ["no gradient", "gradient", "module's pack_padding"])
def test_every_varlen_entry_takes_the_varlen_route(monkeypatch, entry):
    if entry == "module's pack_padding":
        x, pad = _x(), torch.zeros(2, 6, dtype=torch.bool)
        pad[0, 4:] = True

        def call():
            with torch.no_grad():
                return _module(pack_padding=True)(x, x, x, key_padding_mask=pad, need_weights=False)
    else:
        args = _varlen_inputs(entry == "gradient")

        def call():
            return hkt.hkt_attention_varlen(*args, is_causal=True)
    call()
    _blocked(monkeypatch, "varlen")
    with pytest.raises(Reached):
        call()


def _decode_call():
    torch.manual_seed(3)
    B, H, S, D, L = 1, 2, 8, 4, 2
    q = [torch.randn(B, H, 1, D, dtype=torch.float64) for _ in range(L)]
    k_cache = [torch.randn(B, H, level_len(S, l), D, dtype=torch.float64) for l in range(L)]
    v_cache = torch.randn(B, H, S, D, dtype=torch.float64)
    return lambda: hkt.hkt_attention_with_kvcache(q, k_cache, v_cache, torch.tensor([0.6, 0.4],
                                                                                   dtype=torch.float64), 5)


def _module_decode():
    m = _module().eval()
    x = _x(3)
    with torch.no_grad():
        cache = m.init_cache(2, 8)
        return m.decode(x, cache)


@pytest.mark.parametrize("entry", ["functional", "module's decode"])
def test_every_decoding_entry_takes_the_decoding_route(monkeypatch, entry):
    call = _decode_call() if entry == "functional" else _module_decode
    call()
    _blocked(monkeypatch, "decode")
    with pytest.raises(Reached):
        call()


@pytest.mark.parametrize("entry", ["functional", "functional, gradient", "module's coarse levels"])
def test_every_downsampling_entry_takes_the_downsampling_route(monkeypatch, entry):
    x, taps = torch.randn(2, 7, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    calls = {"functional": lambda: causal_downsample(x, taps),
             "functional, gradient": lambda: causal_downsample(x.requires_grad_(), taps),
             "module's coarse levels": lambda: _module()(_x(), _x(), _x(), need_weights=False)}
    calls[entry]()
    _blocked(monkeypatch, "downsample")
    with pytest.raises(Reached):
        calls[entry]()


# what only a route may call: each family's kernel entries, autograd Functions and ops
_ROUTE_ONLY = {"_forward", "_varlen_forward", "_decode", "_downsample_forward", "AttentionFunction",
               "QKVAttentionFunction", "VarlenFunction", "DownsampleFunction", "attention_forward",
               "varlen_forward", "decode", "decode_append"}


@pytest.mark.parametrize("entry", ["functional.py", "varlen.py", "kvcache.py", "downsample.py",
                                   "nn/modules.py", "nn/_mha_inputs.py", "nn/_mha_levels.py",
                                   "decoding/level_cache.py"])
def test_no_entry_calls_a_family_s_kernels_but_through_its_route(entry):
    tree = ast.parse((ROOT / "hkt" / entry).read_text())
    named = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and not (isinstance(n.value, ast.Name) and n.value.id == "_route")}  # the route's own names
    named |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    named |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not (named & _ROUTE_ONLY), (entry, named & _ROUTE_ONLY)


def test_the_default_scale_and_the_dropout_seed_are_each_made_in_one_place():
    # the library's layers (the oracle, the paper's analysis and the integrations
    # keep their own maths): 1/sqrt(D) only in _core/maths.py, a seed drawn only
    # in ops/attention.py's dropout_seed
    made = {"sqrt": set(), "randint": set()}
    for path in sorted((ROOT / "hkt").rglob("*.py")):
        rel = path.relative_to(ROOT / "hkt").as_posix()
        if rel in ("reference.py", "analysis.py") or rel.startswith("integrations/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in made:
                    made[name].add(rel)
    assert made == {"sqrt": {"_core/maths.py"}, "randint": {"ops/attention.py"}}, made
