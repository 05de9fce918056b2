"""What happens to a MultiheadHKT and the attention it replaces over a model's
life: weights that the source computes (parametrizations, pruning hooks),
nn.MultiheadAttention subclasses that compute otherwise, hooks during
decoding, and checkpoints."""
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, parametrizations, prune

import hkt

E, H = 16, 4


class _Counted(nn.Module):
    """An identity parametrization that counts its evaluations."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def forward(self, w):
        self.n += 1
        return w


def _mha(seed=0, **kw):
    torch.manual_seed(seed)
    return nn.MultiheadAttention(E, H, batch_first=True, **kw)


def _x(T=6, B=2, seed=1):
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed))


def _no_warnings(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


# --------------------------------------------------------------------------- from_mha of computed weights

@pytest.mark.parametrize("levels", [1, 3])
def test_parametrized_weights_train_after_from_mha_as_before(levels):
    """A parametrized weight read under no_grad never requires grad; its copy
    must train as the parametrization's original did, and say that the
    parametrization itself stays behind."""
    mha = _mha()
    parametrizations.weight_norm(mha.out_proj)
    parametrize.register_parametrization(mha, "in_proj_weight", _Counted())
    x = _x()
    with pytest.warns(UserWarning) as got:
        new = hkt.MultiheadHKT.from_mha(mha, levels)
    said = " ".join(str(w.message) for w in got)
    assert "mha.in_proj_weight: is computed by" in said and "mha.out_proj.weight: is computed by" in said
    assert new.in_proj_weight.requires_grad and new.out_proj.weight.requires_grad
    assert not parametrize.is_parametrized(new.out_proj)
    torch.testing.assert_close(new(x, x, x)[0], mha(x, x, x)[0], rtol=1e-5, atol=1e-6)
    new(x, x, x)[0].square().sum().backward()
    assert new.in_proj_weight.grad is not None and new.out_proj.weight.grad is not None

    # a frozen original stays frozen (LoRA-style: the base weight does not train)
    mha.out_proj.parametrizations.weight.original0.requires_grad_(False)
    mha.out_proj.parametrizations.weight.original1.requires_grad_(False)
    with pytest.warns(UserWarning) as got:
        new = hkt.MultiheadHKT.from_mha(mha, levels)
    assert sorted(str(w.message).split(":")[0] for w in got) == ["mha.in_proj_weight", "mha.out_proj.weight"]
    assert not new.out_proj.weight.requires_grad and new.in_proj_weight.requires_grad


def test_pruned_weight_trains_after_swap_whatever_the_last_forward():
    """torch.nn.utils.prune recomputes in_proj_weight in a pre-hook; after a
    forward under no_grad the stored tensor does not require grad, yet
    in_proj_weight_orig trains."""
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True).eval()
    prune.l1_unstructured(layer.self_attn, "in_proj_weight", amount=0.5)
    x = _x()
    with torch.no_grad():
        want = layer(x)
    with pytest.warns(UserWarning, match="mha.in_proj_weight: is computed by the forward pre-hook"):
        hkt.swap_attention(layer, levels=2)
    assert layer.self_attn.in_proj_weight.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)


def test_plain_weights_copy_without_warning():
    _no_warnings(lambda: hkt.MultiheadHKT.from_mha(_mha(), 3))


# --------------------------------------------------------------------------- subclasses

def test_subclass_with_its_own_forward_is_refused_before_anything_is_replaced():
    """torch.ao's quantizable MultiheadAttention computes with linear_Q/K/V; its
    in_proj_weight is a leftover that from_mha would copy."""
    quantizable = pytest.importorskip("torch.ao.nn.quantizable")
    q = quantizable.MultiheadAttention(E, H, batch_first=True)
    with pytest.raises(TypeError, match=r"^mha: .*MultiheadAttention has its own forward"):
        hkt.MultiheadHKT.from_mha(q, 1)
    model = nn.ModuleDict({"plain": _mha(), "quant": q})
    with pytest.raises(TypeError, match=r"^mha: "):
        hkt.swap_attention(model)
    assert type(model["plain"]) is nn.MultiheadAttention and model["quant"] is q

    class Named(nn.MultiheadAttention):  # forward inherited: computes MHA's function
        pass
    assert isinstance(hkt.MultiheadHKT.from_mha(Named(E, H), 2), hkt.MultiheadHKT)


# --------------------------------------------------------------------------- one read per forward

@pytest.mark.parametrize("levels", [1, 3])
@pytest.mark.parametrize("self_attention", [True, False])
def test_a_parametrization_is_computed_once_per_forward(levels, self_attention):
    m = hkt.MultiheadHKT(E, H, batch_first=True, levels=levels)
    cin, cout = _Counted(), _Counted()
    parametrize.register_parametrization(m, "in_proj_weight", cin)
    parametrize.register_parametrization(m.out_proj, "weight", cout)
    x, y = _x(), _x(seed=2)
    for train in (True, False):
        m.train(train)
        cin.n = cout.n = 0
        m(x, x, x) if self_attention else m(x, y, y)
        assert (cin.n, cout.n) == (1, 1)


def test_spectral_norm_on_out_proj_steps_as_in_mha():
    """spectral_norm runs one power iteration per evaluation in training: a
    levels=1 copy must keep pace with the MHA it copies."""
    mha = _mha()
    new = hkt.MultiheadHKT.from_mha(mha, 1)
    torch.manual_seed(3)
    parametrizations.spectral_norm(mha.out_proj)
    torch.manual_seed(3)
    parametrizations.spectral_norm(new.out_proj)
    x = _x()
    for _ in range(3):
        a, b = mha(x, x, x, need_weights=False)[0], new(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(new.out_proj.parametrizations.weight[0]._u,
                               mha.out_proj.parametrizations.weight[0]._u, rtol=0, atol=0)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- decoding and hooks

def _decoded(m, seq, chunk):
    with torch.no_grad():
        cache = m.init_cache(seq.shape[0], seq.shape[1])
        return torch.cat([m.decode(seq[:, t:t + chunk], cache) for t in range(0, seq.shape[1], chunk)], 1)


def _forward(m, seq):
    with torch.no_grad():
        return m(seq, seq, seq, is_causal=True, need_weights=False)[0]


def _sgd_step(m, seq):
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    m.train()
    m(seq, seq, seq, is_causal=True)[0].square().sum().backward()
    opt.step()
    m.eval()


@pytest.mark.parametrize("chunk", [1, 2])
def test_decode_runs_out_proj_hooks_as_forward(chunk):
    torch.manual_seed(4)
    m = hkt.MultiheadHKT(E, H, batch_first=True, levels=3).eval()
    seq = _x()
    m.out_proj.register_forward_hook(lambda mod, inp, out: out * 2.0 + 1.0)  # an adapter
    torch.testing.assert_close(_decoded(m, seq, chunk), _forward(m, seq), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 3])
def test_decode_reads_weights_recomputed_by_pruning_prehooks(chunk):
    """prune's pre-hooks recompute in_proj_weight (on the module) and
    out_proj.weight from their _orig on every call; after an optimiser step,
    decode before any forward must see the new weights."""
    torch.manual_seed(5)
    m = hkt.MultiheadHKT(E, H, batch_first=True, levels=3)
    prune.l1_unstructured(m, "in_proj_weight", amount=0.5)
    prune.l1_unstructured(m.out_proj, "weight", amount=0.5)
    seq = _x()
    _sgd_step(m, seq)
    got = _decoded(m, seq, chunk)
    torch.testing.assert_close(got, _forward(m, seq), rtol=1e-5, atol=1e-6)


def test_decode_reads_weights_of_the_old_weight_norm():
    torch.manual_seed(6)
    m = hkt.MultiheadHKT(E, H, batch_first=True, levels=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of the parametrization
        torch.nn.utils.weight_norm(m.out_proj)
        torch.nn.utils.weight_norm(m, "in_proj_weight")
    seq = _x()
    _sgd_step(m, seq)
    got = _decoded(m, seq, 1)
    torch.testing.assert_close(got, _forward(m, seq), rtol=1e-5, atol=1e-6)


def test_decode_with_parametrized_weights_matches_forward():
    torch.manual_seed(7)
    m = hkt.MultiheadHKT(E, H, batch_first=True, levels=3)
    parametrizations.weight_norm(m.out_proj)
    parametrizations.orthogonal(m, "in_proj_weight")
    seq = _x()
    _sgd_step(m, seq)
    torch.testing.assert_close(_decoded(m, seq, 1), _forward(m, seq), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- checkpoints

def test_an_mha_checkpoint_loads_before_the_swap():
    """The order from_mha's docstring asks for: load the MHA checkpoint, then
    swap; the swapped model computes the checkpoint's function."""
    def make():
        return nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True)
    torch.manual_seed(8)
    pretrained = make()
    x = _x()
    torch.manual_seed(9)
    model = make()
    model.load_state_dict(pretrained.state_dict())
    hkt.swap_attention(model, levels=3)
    with torch.no_grad():
        torch.testing.assert_close(model(x), pretrained(x), rtol=1e-5, atol=1e-5)
