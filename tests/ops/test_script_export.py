"""MultiheadHKT under TorchScript (torch.jit.script, torch.jit.trace) and torch.export.

A scripted or exported model must compute what the eager one computes, forward
and backward: the scripted module calls the same registered op
(torch.ops.hkt.attention_forward), whose autograd formula runs from the
TorchScript interpreter as from Python.
"""
import io
import subprocess
import sys
import textwrap
from typing import Optional

import pytest
import torch
from torch import Tensor, nn

import hkt

from helpers import randomize

F64 = torch.float64

# torch 2.13 marks torch.jit.script deprecated; it is what this file tests
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def _randomize(module, seed=0):
    return randomize(module, seed, scale=0.3)


def _encoder(layer_cls=nn.TransformerEncoderLayer, **kw):
    torch.manual_seed(0)
    layer = layer_cls(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True, **kw)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    hkt.swap_attention(model, levels=3)
    return _randomize(model)


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], msg=n)


def test_scripted_encoder_matches_eager():
    model = _encoder()
    scripted = torch.jit.script(model)
    x = torch.randn(3, 10, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(10)
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, 7:] = True
    for train in (False, True):
        model.train(train)
        scripted.train(train)
        for kw in (dict(mask=causal, is_causal=True), dict(src_key_padding_mask=pad), dict()):
            want = model(x, **kw)
            got = scripted(x, **kw)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # gradients of every parameter, and of the input
    xg = x.clone().requires_grad_()
    g_eager = _grads(model, model(xg, mask=causal, is_causal=True).square().mean())
    gx_eager = xg.grad.clone()
    xg.grad = None
    g_script = _grads(scripted, scripted(xg, mask=causal, is_causal=True).square().mean())
    _assert_same_grads(g_script, g_eager)
    torch.testing.assert_close(xg.grad, gx_eager)


class _ScaledResidualLayer(nn.TransformerEncoderLayer):
    """A user's own layer: pre-norm and a learned scale on the attention branch
    (annotated, as TorchScript needs for an overridden method)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, norm_first=True, **kw)
        self.branch_scale = nn.Parameter(torch.tensor(0.7))

    def _sa_block(self, x: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                  is_causal: bool = False) -> Tensor:
        out = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                             need_weights=False, is_causal=is_causal)[0]
        return self.branch_scale * self.dropout1(out)


def test_scripted_subclassed_layer_matches_eager():
    model = _encoder(_ScaledResidualLayer)
    assert isinstance(model.layers[0].self_attn, hkt.MultiheadHKT)
    scripted = torch.jit.script(model)
    x = torch.randn(2, 9, 16)
    mask = torch.randn(9, 9)  # a float (additive) mask
    torch.testing.assert_close(scripted(x, mask=mask), model(x, mask=mask), rtol=0, atol=0)
    g_eager = _grads(model, model(x, mask=mask).sum())
    g_script = _grads(scripted, scripted(x, mask=mask).sum())
    _assert_same_grads(g_script, g_eager)


def test_scripted_transformer_with_cross_attention():
    """nn.Transformer: encoder self-attention, decoder self- and cross-attention
    (T != S), all swapped."""
    torch.manual_seed(0)
    model = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32,
                           dropout=0.0, batch_first=True)
    _randomize(hkt.swap_attention(model, levels=2))
    scripted = torch.jit.script(model)
    src, tgt = torch.randn(2, 9, 16), torch.randn(2, 6, 16)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(6)
    kw = dict(tgt_mask=tgt_mask, tgt_is_causal=True)
    torch.testing.assert_close(scripted(src, tgt, **kw), model(src, tgt, **kw), rtol=0, atol=0)


MODULE_CASES = {
    "kdim_vdim": dict(kdim=5, vdim=3),
    "kdim_vdim_seq_first_no_bias": dict(kdim=5, vdim=3, bias=False, batch_first=False),
    "bias_kv_zero_attn": dict(add_bias_kv=True, add_zero_attn=True),
    "one_level": dict(levels=1),
}


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_scripted_module_matches_eager(case):
    kw = dict(batch_first=True, levels=3)
    kw.update(MODULE_CASES[case])
    torch.manual_seed(1)
    m = _randomize(hkt.MultiheadHKT(8, 2, dtype=F64, **kw)).eval()
    if case.startswith("kdim"):
        assert m.in_proj_weight is None
    sm = torch.jit.script(m)
    B, T, S = 2, 7, 6
    bf = m.batch_first
    q = torch.randn((B, T, 8) if bf else (T, B, 8), dtype=F64)
    k = torch.randn((B, S, m.kdim) if bf else (S, B, m.kdim), dtype=F64)
    v = torch.randn((B, S, m.vdim) if bf else (S, B, m.vdim), dtype=F64)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, -2:] = True
    calls = [
        dict(),
        dict(key_padding_mask=pad, average_attn_weights=False),
        dict(attn_mask=torch.randn(T, S, dtype=F64), key_padding_mask=pad),
        dict(attn_mask=torch.rand(B * 2, T, S) > 0.5, need_weights=False),
    ]
    for c in calls:
        want_out, want_w = m(q, k, v, **c)
        got_out, got_w = sm(q, k, v, **c)
        torch.testing.assert_close(got_out, want_out, rtol=0, atol=0)
        if want_w is None:
            assert got_w is None
        else:
            torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)
    # self-attention, causal, and unbatched input
    if m.kdim == m.embed_dim and m.vdim == m.embed_dim:
        torch.testing.assert_close(sm(q, q, q, is_causal=True)[0], m(q, q, q, is_causal=True)[0], rtol=0, atol=0)
        u = q[0] if bf else q[:, 0]
        torch.testing.assert_close(sm(u, u, u)[0], m(u, u, u)[0], rtol=0, atol=0)


def test_scripted_errors_keep_their_message():
    sm = torch.jit.script(hkt.MultiheadHKT(8, 2, batch_first=True))
    x = torch.randn(2, 5, 8)
    with pytest.raises(torch.jit.Error, match="attn_mask: 2-D shape must be"):
        sm(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.bool))
    with pytest.raises(torch.jit.Error, match="key_padding_mask: only bool and floating point"):
        sm(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.int64))


def test_scripted_model_saves_and_loads_in_a_new_process(tmp_path):
    """torch.jit.save'd, then loaded and run by a process that imports hkt (which
    registers the op) and not the model's Python code."""
    model = _encoder().eval()
    x = torch.randn(2, 8, 16)
    path = tmp_path / "model.pt"
    torch.jit.script(model).save(str(path))
    torch.save(x, tmp_path / "x.pt")
    torch.save(model(x).detach(), tmp_path / "want.pt")
    script = textwrap.dedent(f"""
        import torch, hkt
        m = torch.jit.load({str(path)!r})
        x = torch.load({str(tmp_path / 'x.pt')!r})
        want = torch.load({str(tmp_path / 'want.pt')!r})
        torch.testing.assert_close(m(x), want, rtol=0, atol=0)
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


class _Wrapped(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, mask, pad):
        return self.model(x, mask=mask, src_key_padding_mask=pad, is_causal=True)


class _CausalSelfAttention(nn.Module):
    """m(x, x, x) under is_causal: the output, and with need_weights the weights too."""
    def __init__(self, m, need_weights):
        super().__init__()
        self.m, self.need_weights = m, need_weights

    def forward(self, x):
        out, weights = self.m(x, x, x, need_weights=self.need_weights, is_causal=True)
        return (out, weights) if self.need_weights else out


def _export_inputs():
    x = torch.randn(2, 10, 16)
    mask = torch.ones(10, 10, dtype=torch.bool).triu(1)  # True = hidden, as the padding mask
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, 8:] = True
    return x, mask, pad


@pytest.mark.parametrize("train", [False, True])
def test_export_matches_eager(train):
    model = _Wrapped(_encoder()).train(train)
    args = _export_inputs()
    ep = torch.export.export(model, args)
    assert "hkt.attention_forward" in str(ep.graph)
    exported = ep.module()
    torch.testing.assert_close(exported(*args), model(*args), rtol=0, atol=0)
    if train:  # backward through the exported program: the op's autograd formula
        g_eager = _grads(model, model(*args).square().mean())
        g_export = _grads(exported, exported(*args).square().mean())
        _assert_same_grads(g_export, g_eager)


def test_exported_program_saves_and_loads():
    model = _Wrapped(_encoder()).eval()
    args = _export_inputs()
    buf = io.BytesIO()
    torch.export.save(torch.export.export(model, args), buf)
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    torch.testing.assert_close(loaded(*args), model(*args), rtol=0, atol=0)


def test_export_with_dynamic_sequence_length():
    """One exported program for many sequence lengths.  The length must be a
    multiple of 2^(levels - 1): the downsampling's ceil(n / 2) slices give guards
    the exporter cannot prove for every length."""
    torch.manual_seed(0)
    m = _randomize(hkt.MultiheadHKT(16, 2, batch_first=True, levels=3)).eval()

    wrapped = _CausalSelfAttention(m, need_weights=False)
    blocks = torch.export.Dim("blocks", min=2, max=16)
    ep = torch.export.export(wrapped, (torch.randn(2, 12, 16),), dynamic_shapes={"x": {1: 4 * blocks}})
    for T in (8, 12, 36):
        x = torch.randn(2, T, 16)
        torch.testing.assert_close(ep.module()(x), wrapped(x), rtol=0, atol=0)


def test_returned_weights_stay_dynamic_in_length():
    """The returned weights' coarse levels were upsampled by a repeat cut back
    to T, on which export and compile put a guard (2^l ceil(T / 2^l) == T):
    an exported program with need_weights failed at any other length class,
    and compile made one more graph per class (4 graphs for 13 lengths where
    MHA makes 2; 8, its limit, with inductor).  A gather by index has no such
    guard."""
    torch.manual_seed(0)
    m = _randomize(hkt.MultiheadHKT(16, 2, batch_first=True, levels=3)).eval()

    wrapped = _CausalSelfAttention(m, need_weights=True)
    ep = torch.export.export(wrapped, (torch.randn(2, 12, 16),), dynamic_shapes={"x": {1: torch.export.Dim.AUTO}})
    for T in (5, 13, 31):
        x = torch.randn(2, T, 16)
        for got, want in zip(ep.module()(x), wrapped(x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch._dynamo.reset()
    graphs = []

    def count(gm, inputs):
        graphs.append(gm)
        return gm
    compiled = torch.compile(wrapped, backend=count)
    for T in (8, 12, 13, 17, 21, 30, 31, 33):
        compiled(torch.randn(2, T, 16))
    assert len(graphs) <= 2, len(graphs)  # static at the first length, then dynamic


def test_compiled_swapped_encoder_matches_eager():
    """torch.compile(fullgraph=True) of a swapped encoder: one graph, eager's
    output and gradients."""
    model = _encoder()
    x = torch.randn(2, 10, 16)
    mask = torch.ones(10, 10, dtype=torch.bool).triu(1)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x, mask=mask, is_causal=True)
    torch.testing.assert_close(out, model(x, mask=mask, is_causal=True))
    g_compiled = _grads(model, out.square().mean())
    g_eager = _grads(model, model(x, mask=mask, is_causal=True).square().mean())
    _assert_same_grads(g_compiled, g_eager)


# ---- torch.jit.trace ----

@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("levels", [1, 3])
@pytest.mark.parametrize("grad", [False, True])
def test_traced_module_matches_eager(levels, grad):
    """torch.jit.trace records the registered op (and the downsampling as torch
    ops), never the extension's direct calls, whose trace would replay stale
    memory: a traced model computes what the eager one computes, at the traced
    length and others, forward and backward; pack_padding traces the padded
    call with its zeros."""
    torch.manual_seed(0)
    m = _randomize(hkt.MultiheadHKT(16, 4, batch_first=True, levels=levels, pack_padding=True).double())

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x, kpm):
            return self.m(x, x, x, key_padding_mask=kpm, need_weights=False, is_causal=True)[0]

    def inputs(T):
        x = torch.randn(2, T, 16, dtype=F64, requires_grad=True)
        kpm = torch.arange(T)[None] >= torch.tensor([T, T // 2 + 1])[:, None]
        return x, kpm
    eager = Wrap()
    with torch.set_grad_enabled(grad):
        traced = torch.jit.trace(eager, inputs(16))
    assert "hkt::attention_forward" in str(traced.inlined_graph)
    for T in (16, 23, 5):
        x, kpm = inputs(T)
        got, want = traced(x, kpm), eager(x, kpm)
        assert torch.equal(got, want)
        assert torch.equal(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_traced_functional_matches_eager():
    from helpers import sample_inputs
    q, k, v, w = sample_inputs(1, 2, 9, 9, 4, 4, 2)
    traced = torch.jit.trace(lambda q0, q1, k0: hkt.hkt_attention([q0, q1], [k0, k[1]], v, w, is_causal=True),
                             (q[0], q[1], k[0]))
    q0 = torch.randn(q[0].shape, dtype=F64)
    assert torch.equal(traced(q0, q[1], k[0]), hkt.hkt_attention([q0, q[1]], k, v, w, is_causal=True))


def test_trace_refuses_the_kernels_it_cannot_record():
    """Decoding and variable-length attention have no registered op: under
    torch.jit.trace they raise, rather than record nothing."""
    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = hkt.MultiheadHKT(16, 4, batch_first=True).eval()
            self.cache = self.m.init_cache(1, 8)

        def forward(self, x):
            return self.m.decode(x, self.cache)
    with torch.no_grad(), pytest.raises(RuntimeError, match="^hkt_attention_with_kvcache: torch.jit.trace cannot"):
        torch.jit.trace(Step(), (torch.randn(1, 1, 16),))
    q = [torch.randn(6, 2, 4)]
    cu = torch.tensor([0, 6])
    with pytest.raises(RuntimeError, match="^hkt_attention_varlen: torch.jit.trace cannot"):
        torch.jit.trace(lambda q0: hkt.hkt_attention_varlen([q0], q, q[0], torch.ones(1), cu, cu), (q[0],))


def test_fx_symbolic_trace_is_told_how_to_keep_the_module_whole():
    """torch.fx.symbolic_trace traces into modules outside torch.nn, and
    MultiheadHKT's forward branches on shapes and values: a TypeError that says
    what to do, and that recipe (the module as a leaf, as fx keeps
    nn.MultiheadAttention) gives a graph module that computes what the model does."""
    torch.manual_seed(0)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = hkt.MultiheadHKT(16, 4, batch_first=True)

        def forward(self, x):
            return self.a(x, x, x, need_weights=False, is_causal=True)[0]
    model = Wrap()
    with pytest.raises(TypeError, match="^query: torch.fx.symbolic_trace cannot trace into MultiheadHKT"):
        torch.fx.symbolic_trace(model)

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, hkt.MultiheadHKT) or super().is_leaf_module(m, name)
    graph_module = torch.fx.GraphModule(model, Tracer().trace(model))
    x = torch.randn(2, 9, 16)
    assert torch.equal(graph_module(x), model(x))
