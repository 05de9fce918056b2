"""The paper's theory as tools that run: cost, score decompositions, the PSD
condition, the expressivity constructions and the approximation-error curve.

Shapes: B batch, H heads, T sequence length, E embed_dim, hd = E / H head dim,
L levels.  Functions that take a :class:`hkt.MultiheadHKT` and an input ``x``
treat it as self-attention (query = key = value = ``x``) and read ``x`` the way
the module's ``forward`` does: (T, E) unbatched, (T, B, E), or (B, T, E) with
``batch_first``.

* Cost (docs/contract.md section 1.6): :func:`cost_ratio` is sum_l 4^-l; :func:`count_score_macs`
  counts the multiply-adds the CPU kernel performs for the scores, tile by tile.
* Props 3.5-3.6: :func:`split_symmetric` (the unique symmetric + antisymmetric
  split), :func:`bilinear_forms` (each level's W_Q W_K^T per head) and
  :func:`level_scores_from_forms` (a level's score computed from any form, so the
  split of the score is seen to be the score of the split form).
* Prop 3.1: :func:`psd_condition` (exact check of the sufficient condition) and
  :func:`kernel_eigenvalues` (the resulting kernel matrix on data).
* Prop 3.4: :meth:`hkt.MultiheadHKT.from_mha` reproduces standard attention;
  :func:`causal_conv_as_hkt` builds a MultiheadHKT that computes a given causal
  convolution.
* Thm 4.3 / Prop 4.4: :func:`approximation_error_curve` (synthetic multi-scale
  data), :func:`kernel_approximation_curve` (any kernel matrices, e.g. a trained
  model's activations) and :func:`plot_approximation_error`.
"""
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ._core.kernels import cpu_tile
from .nn.modules import MultiheadHKT
from .reference import level_terms, repeat_kv, upsample_level

__all__ = [
    "cost_ratio", "count_score_macs", "measured_cost_ratio",
    "level_queries_keys", "LevelScores", "level_scores", "split_symmetric", "bilinear_forms",
    "level_scores_from_forms", "PSDCondition", "psd_condition", "kernel_eigenvalues",
    "causal_conv1d", "causal_conv_as_hkt",
    "multiscale_kernel", "best_level_fit", "approximation_error_curve", "kernel_approximation_curve",
    "plot_approximation_error",
]

# The CPU kernel's query and key tile size, as the extension was built with it.
KERNEL_TILE = cpu_tile


# --------------------------------------------------------------------------- cost

def _check_int(name: str, value, low: int) -> None:
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")


def cost_ratio(levels: int) -> float:
    """Score cost of ``levels`` levels relative to standard attention:
    sum_{l < L} 4^-l (1, 1.25, 1.3125, ... < 4/3), since level l has
    (T / 2^l) x (S / 2^l) scores of the same head dim."""
    _check_int("levels", levels, 1)
    return sum(4.0**-l for l in range(levels))


def count_score_macs(B: int, H: int, T: int, S: int, D: int, L: int, *, is_causal: bool = False,
                     tile: int = KERNEL_TILE, sliding_window: Optional[int] = None) -> int:
    """Multiply-adds the CPU forward kernel spends on score Gram blocks.

    Mirrors csrc/cpu/hkt_attention_body.h: queries and keys are walked in ``tile`` x
    ``tile`` tiles; for tile [i0, i1) x [j0, j1) and level l the kernel forms
    the Gram block of level-l rows r0 = i0 >> l .. (i1 - 1) >> l and columns
    c0 = j0 >> l .. (j1 - 1) >> l, D multiply-adds per entry.  With
    ``is_causal`` a query tile visits only key tiles with j0 < min(S, i1); with
    ``sliding_window`` W only those from the one holding key i0 - W + 1 on
    (and, without ``is_causal``, with j0 < i1 - 1 + W): the work grows as T * W.
    (The backward recomputes exactly the same tiles, so a training step spends
    twice this on scores.)  For 2^l <= tile the blocks of a level partition its
    grid, so the count is close to T*S*D*cost_ratio(L); a level with 2^l > tile
    is recomputed once per tile (one entry each), which costs a little more.

    Returns:
        The count as a Python int (B * H * D * sum over tiles and levels of rl * cl).
    """
    for name, val in (("B", B), ("H", H), ("T", T), ("S", S), ("D", D)):
        if val < 0:
            raise ValueError(f"{name}: must be >= 0, got {val}")
    if L < 1:
        raise ValueError(f"L: must be >= 1, got {L}")
    _check_int("tile", tile, 1)
    if T == 0 or S == 0:
        return 0
    i0 = torch.arange(0, T, tile, dtype=torch.int64)
    i1 = torch.clamp(i0 + tile, max=T)
    j0 = torch.arange(0, S, tile, dtype=torch.int64)
    j1 = torch.clamp(j0 + tile, max=S)
    visited = torch.ones(len(i0), len(j0), dtype=torch.bool)
    if is_causal:
        visited = j0[None, :] < torch.clamp(i1, max=S)[:, None]
    if sliding_window is not None:
        _check_int("sliding_window", sliding_window, 1)
        first = torch.clamp(i0 - sliding_window + 1, min=0) // tile * tile
        visited = visited & (j0[None, :] >= first[:, None])
        if not is_causal:
            visited = visited & (j0[None, :] < (i1 - 1 + sliding_window)[:, None])
    total = 0
    for l in range(L):
        rl = ((i1 - 1) >> l) + 1 - (i0 >> l)
        cl = ((j1 - 1) >> l) + 1 - (j0 >> l)
        total += int(((rl[:, None] * cl[None, :]) * visited).sum())
    return B * H * D * total


def measured_cost_ratio(T: int, S: int, L: int, *, is_causal: bool = False) -> float:
    """count_score_macs with L levels over the count with one level (standard
    attention walked over the same tiles)."""
    for name, val in (("T", T), ("S", S)):
        if val < 1:  # no scores: the ratio is 0 / 0
            raise ValueError(f"{name}: must be >= 1, got {val}")
    return count_score_macs(1, 1, T, S, 1, L, is_causal=is_causal) / count_score_macs(1, 1, T, S, 1, 1,
                                                                                     is_causal=is_causal)


# ------------------------------------------------------------ per-level scores

def _batch_first(module: MultiheadHKT, x: Tensor) -> Tensor:
    if not isinstance(module, MultiheadHKT):
        raise TypeError(f"module: expected an hkt.MultiheadHKT, got {type(module).__name__}")
    if not isinstance(x, Tensor) or x.dim() not in (2, 3):
        raise ValueError(f"x: expected a (T, E) or 3-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape[-1] != module.embed_dim:
        raise ValueError(f"x: expected {module.embed_dim} features (embed_dim), got {x.shape[-1]}")
    if module.kdim != module.embed_dim:
        raise ValueError("module: self-attention analysis needs kdim == embed_dim, got "
                         f"kdim={module.kdim}, embed_dim={module.embed_dim}")
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError("module: add_bias_kv / add_zero_attn slots are not covered by the analysis")
    if x.dim() == 2:
        return x.unsqueeze(0)
    return x if module.batch_first else x.transpose(0, 1)


def _level_projections(module: MultiheadHKT, bias: bool = True):
    """Per level (W_q (E, E), b_q (E,) or None, W_k (E_kv, kdim), b_k or None), torch
    layout: the module's own (MultiheadHKT.level_projections), biases dropped
    with bias=False (the pure bilinear forms)."""
    return [(wq, bq if bias else None, wk, bk if bias else None) for wq, bq, wk, bk in module.level_projections()]


def level_queries_keys(module: MultiheadHKT, x: Tensor, *, bias: bool = True) -> Tuple[List[Tensor], List[Tensor]]:
    """The per-level queries and keys ``module`` hands to :func:`hkt.hkt_attention`
    for self-attention on ``x``: two lists of L tensors (B, H, ceil(T/2^l), hd)
    (with ``num_kv_heads`` < ``num_heads`` the keys come repeated to H heads, as
    each query head sees them).  ``bias=False`` drops the projection biases (the
    pure bilinear forms)."""
    x = _batch_first(module, x)
    H, hd = module.num_heads, module.head_dim
    xq, xk = module.level_inputs(x, x)

    def heads(t):
        return t.unflatten(-1, (-1, hd)).transpose(1, 2)

    qs, ks = [], []
    for l, (wq, bq, wk, bk) in enumerate(_level_projections(module, bias)):
        qs.append(heads(F.linear(xq[l], wq, bq)))
        ks.append(repeat_kv(heads(F.linear(xk[l], wk, bk)), H))
    return qs, ks


class LevelScores(NamedTuple):
    """``levels`` (L, B, H, T, T): level l's term scale * w_l * <q_l, k_l>, upsampled
    to full resolution; ``combined`` (B, H, T, T): their sum, the score the
    softmax sees (before masks)."""
    levels: Tensor
    combined: Tensor


def level_scores(module: MultiheadHKT, x: Tensor, *, bias: bool = True) -> LevelScores:
    """Each level's score matrix of ``module`` for self-attention on ``x``.

    Level l's entry (i, j) is scale * w[h, l] * <q_l[i >> l], k_l[j >> l]> with
    scale = 1 / sqrt(hd) and w = ``module.level_weights()``, so the levels sum to
    the combined score, and softmax of the combined score (under the same masks)
    is the module's attention probabilities.  ``bias=False`` drops the
    projection biases.  O(L * B * H * T^2) memory: for analysis, not training.
    """
    qs, ks = level_queries_keys(module, x, bias=bias)
    levels = torch.stack(level_terms(qs, ks, module.level_weights(), 1.0 / math.sqrt(module.head_dim)))
    return LevelScores(levels, levels.sum(0))


# --------------------------------------------------- Props 3.5-3.6: the split

def split_symmetric(S: Union[Tensor, Sequence[Tensor]]):
    """The unique split S = sym + anti with sym^T = sym and anti^T = -anti.

    sym = (S + S^T) / 2, anti = (S - S^T) / 2 over the last two dimensions, which
    must be equal.  Uniqueness: if S = A + B is another such split, then
    A - sym = anti - B is symmetric and antisymmetric at once, hence zero.  The
    two parts are orthogonal (trace(sym^T anti) = 0), so
    ||S||^2 = ||sym||^2 + ||anti||^2.

    Args:
        S: (..., n, n), e.g. ``level_scores(m, x).levels`` (L, B, H, T, T), which
            gives one (sym, anti) pair per level stacked along the first
            dimension; or a sequence of such tensors, giving a list of pairs.

    Returns:
        (sym, anti) shaped like S, or a list of such pairs.
    """
    if isinstance(S, (list, tuple)):
        return [split_symmetric(s) for s in S]
    if not isinstance(S, Tensor) or S.dim() < 2 or S.shape[-1] != S.shape[-2]:
        raise ValueError(f"S: expected (..., n, n) square matrices, got {getattr(S, 'shape', type(S).__name__)}")
    St = S.transpose(-1, -2)
    return (S + St) / 2, (S - St) / 2


def bilinear_forms(module: MultiheadHKT, *, bias: bool = True, dtype=None) -> Tensor:
    """Each level's bilinear form, per head: M[l, h] = W_Q^(l)_h W_K^(l)_h^T.

    With W_Q^(l)_h the (E, hd) matrix that maps a level-l token (a row vector)
    to head h's query (torch stores its transpose: rows h*hd .. (h+1)*hd of the
    (E, E) projection weight), level l's unscaled score is
    x_l[i] M[l, h] x_l[j]^T.  With ``bias=True`` and a module that has biases,
    tokens are augmented by a constant 1, x~ = [x, 1], and the form is
    (E + 1, E + 1): [[W_Q W_K^T, W_Q b_K^T], [b_Q W_K^T, b_Q b_K^T]], so the
    biased score is exactly x~_l[i] M x~_l[j]^T.

    ``dtype`` (default: the module's) is the precision of the products:
    float64 for a float32 module gives forms whose eigenvalues are exact to
    float64 rounding (a W W^T form of rank < E' then has its zero eigenvalues
    at ~1e-16, not at float32's ~1e-7, relative).

    Returns:
        (L, H, E', E') with E' = E (+ 1 with biases).
    """
    if not isinstance(module, MultiheadHKT):
        raise TypeError(f"module: expected an hkt.MultiheadHKT, got {type(module).__name__}")
    if module.kdim != module.embed_dim:
        raise ValueError(f"module: bilinear forms on one token space need kdim == embed_dim, got kdim={module.kdim}")
    H, hd = module.num_heads, module.head_dim
    Hk = getattr(module, "num_kv_heads", H)  # (modules pickled before grouped heads have none)
    forms = []
    for wq, bq, wk, bk in _level_projections(module, bias):
        if dtype is not None:
            wq, wk = wq.to(dtype), wk.to(dtype)
            bq, bk = (None if b is None else b.to(dtype) for b in (bq, bk))
        Wq, Wk = wq.reshape(H, hd, -1), wk.reshape(Hk, hd, -1)  # (H, hd, E), (H_kv, hd, E)
        if bias and (bq is not None or bk is not None):
            def col(b, n):  # the bias as an extra input column (zeros without one)
                return torch.zeros(n, hd, 1, dtype=wq.dtype, device=wq.device) if b is None else b.view(n, hd, 1)
            Wq = torch.cat([Wq, col(bq, H)], dim=-1)
            Wk = torch.cat([Wk, col(bk, Hk)], dim=-1)
        # grouped kv heads: query head h reads kv head h // (H / H_kv)
        Wk = Wk.repeat_interleave(H // Hk, dim=0)
        forms.append(Wq.transpose(-1, -2) @ Wk)  # (H, E', E')
    return torch.stack(forms)


def level_scores_from_forms(module: MultiheadHKT, x: Tensor, forms: Tensor) -> Tensor:
    """Level scores scale * w_l * x~_l[i>>l] M[l, h] x~_l[j>>l]^T for any forms.

    With the module's own ``bilinear_forms`` this is ``level_scores(...).levels``.
    When the query and key streams share their downsampling taps (as at
    initialisation), passing the symmetric (antisymmetric) parts of the forms
    gives exactly the symmetric (antisymmetric) parts of the level scores: the
    split of Props 3.5-3.6 is the split of each level's bilinear form.  (With
    different taps the query-side tokens are used on the left, the key-side
    tokens on the right.)

    Args:
        forms: (L, H, E', E') as returned by :func:`bilinear_forms`; E' = E + 1
            means the tokens get a constant 1 appended.

    Returns:
        (L, B, H, T, T).
    """
    x = _batch_first(module, x)
    xq, xk = module.level_inputs(x, x)
    T = x.shape[1]
    E = module.embed_dim
    if forms.dim() != 4 or forms.shape[:2] != (module.levels, module.num_heads) or forms.shape[2] != forms.shape[3] \
            or forms.shape[2] not in (E, E + 1):
        raise ValueError(f"forms: expected (L, H, E, E) or (L, H, E+1, E+1) = "
                         f"({module.levels}, {module.num_heads}, {E}[+1], ...), got {tuple(forms.shape)}")
    aug = forms.shape[2] == E + 1
    scale = 1.0 / math.sqrt(module.head_dim)
    w = module.level_weights()
    out = []
    for l in range(module.levels):
        a, b = xq[l], xk[l]
        if aug:
            a = torch.cat([a, torch.ones_like(a[..., :1])], -1)
            b = torch.cat([b, torch.ones_like(b[..., :1])], -1)
        g = torch.einsum("bpe,hef,bqf->bhpq", a, forms[l], b)
        out.append(scale * w[:, l].view(1, -1, 1, 1) * upsample_level(g, l, T, T))
    return torch.stack(out)


# ------------------------------------------------------- Prop 3.1: PSD kernel

@dataclass
class PSDCondition:
    """Result of :func:`psd_condition`.

    holds: every part of the sufficient condition holds.
    min_eigenvalues: (L, H) smallest eigenvalue of each level's symmetrised form.
    forms_psd: (L, H) bool, min eigenvalue >= -tol * (largest |eigenvalue| of that form).
    weights: (H, L) the level weights; weights_convex: all >= 0 and each row sums to 1.
    shared_downsampling: the query and key streams use the same taps at every
    level, so both sides of a level's form see the same tokens.
    """
    holds: bool
    min_eigenvalues: Tensor
    forms_psd: Tensor
    weights: Tensor
    weights_convex: bool
    shared_downsampling: bool


@torch.no_grad()
def psd_condition(module: MultiheadHKT, *, bias: bool = True, tol: float = 1e-10) -> PSDCondition:
    """Prop 3.1's sufficient condition for the self-attention score to be a PSD kernel.

    The score of tokens i, j is sum_l scale * w_l * x~_l[i>>l] M_l x~_l[j>>l]^T
    (:func:`bilinear_forms`; x~ has a constant 1 appended when there are biases
    and ``bias``).  If both sides read the same level tokens (shared
    downsampling taps), the symmetric part of level l's score matrix is
    U_l X_l sym(M_l) X_l^T U_l^T (U_l the 0/1 upsampling), which is PSD when
    sym(M_l) is; a convex (non-negative) combination of PSD matrices is PSD.
    So the symmetric part of the score matrix is PSD on every input, and the
    score itself is a PSD kernel when the forms are also symmetric.

    Checked exactly: eigenvalues of each (M + M^T) / 2, with M formed from
    the weights in float64 (whatever the module's dtype), with a relative
    tolerance ``tol``; weights non-negative summing to 1 (to 1e-6);
    taps equal.

    Returns:
        :class:`PSDCondition`.
    """
    # forms in float64 from the start: products rounded to float32 would put
    # the zero eigenvalues of a rank-deficient PSD form at ~-1e-7, failing tol
    forms = bilinear_forms(module, bias=bias, dtype=torch.float64)
    sym = (forms + forms.transpose(-1, -2)) / 2
    ev = torch.linalg.eigvalsh(sym)  # (L, H, E'), ascending
    mins = ev[..., 0]
    bound = tol * ev.abs().amax(-1).clamp_min(torch.finfo(torch.float64).tiny)
    forms_psd = mins >= -bound
    w = module.level_weights().detach()
    convex = bool((w >= 0).all()) and bool(torch.allclose(w.sum(-1).double(), torch.ones(w.shape[0],
                                                                                         dtype=torch.float64),
                                                          atol=1e-6))
    shared = module.levels == 1 or bool(torch.equal(module.q_downsample, module.k_downsample))
    return PSDCondition(bool(forms_psd.all()) and convex and shared, mins, forms_psd, w, convex, shared)


@torch.no_grad()
def kernel_eigenvalues(module: MultiheadHKT, x: Tensor, *, bias: bool = True) -> Tensor:
    """Eigenvalues of the kernel matrix the module forms on data ``x``.

    The kernel matrix is the symmetric part (S + S^T) / 2 of the combined
    score matrix S (:func:`level_scores`), the part a quadratic form
    z^T S z sees; under :func:`psd_condition` it is PSD for every ``x``, so
    all eigenvalues are >= 0 up to rounding.

    Returns:
        (B, H, T) eigenvalues in ascending order, float64.
    """
    S = level_scores(module, x, bias=bias).combined.double()
    return torch.linalg.eigvalsh((S + S.transpose(-1, -2)) / 2)


# ------------------------------------------- Prop 3.4: standard attention, conv

def causal_conv1d(u: Tensor, weight: Tensor) -> Tensor:
    """Causal convolution y[t] = sum_{r < K} weight[:, :, K-1-r] @ u[t - r]
    (zero before the start), i.e. ``F.conv1d`` with K - 1 zeros padded on the
    left.  u (B, T, C), weight (C_out, C, K) -> (B, T, C_out)."""
    K = weight.shape[-1]
    return F.conv1d(F.pad(u.transpose(1, 2), (K - 1, 0)), weight).transpose(1, 2)


def causal_conv_as_hkt(weight: Tensor, *, levels: int = 3, sharpness: float = 40.0, dtype=torch.float64
                       ) -> Tuple[MultiheadHKT, Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """A MultiheadHKT that computes a given causal convolution (Prop 3.4).

    Construction (positional attention in the style of Cordonnier et al. 2020),
    for ``weight`` (C_out, C, K):

    * Tokens.  ``encode(u)`` turns u (B, T, C) into x (B, T + K - 1, E): K - 1
      zero tokens first (the convolution's zero padding), then per position n
      the features [u_n (C), n, n^2] and zeros up to E = K * hd, hd = max(C,
      C_out) + 2.
    * One head per tap r = 0 .. K-1.  Its query is a * [n - r, 1] and its key
      is [2m, -m^2] (from the n and n^2 features; the -a r and a entries are
      query biases), so the score of key m is a (2m (n - r) - m^2) =
      -a (m - (n - r))^2 + (terms of n only): the softmax peaks at m = n - r,
      and every other key trails by at least a.  a = sharpness / (scale * w_0)
      undoes the score scale 1 / sqrt(hd) and level 0's weight w_0, so the gap
      is ``sharpness`` nats and the attention is one-hot to exp(-sharpness).
    * Values copy u into the first C dims of each head; the output projection
      maps head r's copy through weight[:, :, K - 1 - r], so the output at n is
      sum_r weight[:, :, K-1-r] u_{n-r}: the convolution.  Pad tokens carry
      u = 0, so taps reaching before the start add nothing, as zero padding.
    * Levels >= 1 are switched off by zero query projections (weights and
      biases); level_logits = 0 gives w_0 = 1 / levels, absorbed in a.
      ``is_causal=True`` may be passed (the peak m = n - r is never in the future).

    Args:
        weight: (C_out, C, K) as for ``F.conv1d`` (see :func:`causal_conv1d`).
        levels: levels of the module.
        sharpness: softmax gap in nats; 40 is exact to float64 rounding.
        dtype: dtype of the module (positions squared need float64 beyond a few
            hundred steps).

    Returns:
        (module, encode, decode): ``decode(module(x, x, x)[0])`` is the
        convolution of ``u`` when ``x = encode(u)``, batch_first.
    """
    if weight.dim() != 3:
        raise ValueError(f"weight: expected (C_out, C, K), got shape {tuple(weight.shape)}")
    C_out, C, K = weight.shape
    hd = max(C, C_out) + 2
    E = K * hd
    pos, pos2 = C, C + 1  # feature indices of n and n^2
    m = MultiheadHKT(E, K, batch_first=True, levels=levels, dtype=dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        w0 = float(m.level_weights()[0, 0]) if levels > 1 else 1.0
        a = sharpness * math.sqrt(hd) / w0
        wq, wk, wv, bq, bk, bv = m.in_projections()
        for r in range(K):
            o = r * hd
            wq[o, pos] = a
            bq[o] = -a * r
            bq[o + 1] = a
            wk[o, pos] = 2.0
            wk[o + 1, pos2] = -1.0
            for c in range(C):
                wv[o + c, c] = 1.0
            m.out_proj.weight[:C_out, o:o + C] = weight[:, :, K - 1 - r].to(dtype)
        if levels > 1:
            m.q_downsample.fill_(1.0 / m.downsample_kernel)
            m.k_downsample.fill_(1.0 / m.downsample_kernel)

    def encode(u: Tensor) -> Tensor:
        B, T, Cu = u.shape
        if Cu != C:
            raise ValueError(f"u: expected {C} channels, got {Cu}")
        x = torch.zeros(B, T + K - 1, E, dtype=dtype, device=u.device)
        x[:, K - 1:, :C] = u.to(dtype)
        n = torch.arange(T + K - 1, dtype=dtype, device=u.device)
        x[:, :, pos] = n
        x[:, :, pos2] = n * n
        return x

    def decode(out: Tensor) -> Tensor:
        return out[:, K - 1:, :C_out]

    return m, encode, decode


# ------------------------------------ Thm 4.3 / Prop 4.4: error decays with L

def _block_sizes(T: int, l: int, dtype) -> Tensor:
    n = -(-T // 2**l)
    sizes = torch.full((n,), float(2**l), dtype=dtype)
    sizes[-1] = T - (n - 1) * 2**l
    return sizes


def _down_mean(A: Tensor, l: int) -> Tensor:
    """Block means of A (T, T) over 2^l x 2^l blocks -> (ceil(T/2^l),) ^ 2."""
    if l == 0:
        return A
    T = A.shape[-1]
    n, f = -(-T // 2**l), 2**l
    Ap = F.pad(A, (0, n * f - T, 0, n * f - T))
    sums = Ap.view(n, f, n, f).sum((1, 3))
    sz = _block_sizes(T, l, A.dtype)
    return sums / (sz[:, None] * sz[None, :])


def _best_level_term(R: Tensor, l: int, rank: int) -> Tensor:
    """argmin over rank-<= ``rank`` G of ||U_l G U_l^T - R||_F, returned upsampled (T, T).

    With N = diag(block sizes), ||U G U^T - R||^2 = ||N^1/2 (G - Gm) N^1/2||^2 + const
    where Gm is the block-mean matrix; so truncate the SVD of N^1/2 Gm N^1/2."""
    T = R.shape[-1]
    Gm = _down_mean(R, l)
    s = _block_sizes(T, l, R.dtype).sqrt()
    U, sv, Vh = torch.linalg.svd(s[:, None] * Gm * s[None, :])
    k = min(rank, sv.numel())
    G = (U[:, :k] * sv[:k]) @ Vh[:k] / (s[:, None] * s[None, :])
    return upsample_level(G, l, T, T)


def best_level_fit(A: Tensor, levels: int, rank: int, *, sweeps: int = 10) -> Tensor:
    """Approximates A (T, T) by sum_{l < levels} U_l G_l U_l^T with rank(G_l) <= rank.

    This is the HKT score model of one head with head dim ``rank``: level l's
    score is constant on 2^l x 2^l blocks and has rank <= hd.  Fitted by
    backfitting from zero: each level in turn gets the best fit of what the
    others leave (:func:`_best_level_term`), ``sweeps`` rounds, so no step
    increases the error.  The problem is not convex (rank limits), so two
    starts are tried, levels visited finest first and coarsest first, and the
    better result is returned: an upper bound on the best L-level error.

    Returns:
        The approximation (T, T).
    """
    _check_int("levels", levels, 1)
    _check_int("rank", rank, 0)
    if not isinstance(A, Tensor) or A.dim() != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"A: expected a square (T, T) tensor, got "
                         f"{tuple(A.shape) if isinstance(A, Tensor) else type(A).__name__}")
    best, best_err = None, None
    for order in (list(range(levels)), list(reversed(range(levels)))):
        terms = [torch.zeros_like(A) for _ in range(levels)]
        for _ in range(max(1, sweeps)):
            for l in order:
                terms[l] = _best_level_term(A - (sum(terms) - terms[l]), l, rank)
        approx = sum(terms)
        err = float(torch.linalg.norm(A - approx))
        if best is None or err < best_err:
            best, best_err = approx, err
        if levels == 1:
            break
    return best


def multiscale_kernel(T: int, *, rank: int = 4, scales: int = 8, decay: float = 0.5, smooth: bool = False,
                      seed: int = 0, dtype=torch.float64) -> Tensor:
    """A kernel matrix A = X X^T of multi-scale data, (T, T).

    X (T, rank * scales) stacks, for s = 0 .. scales-1, decay^s times a random
    rank-``rank`` signal that varies on the scale of 2^s positions: i.i.d.
    Gaussian values on the level-s grid, held constant over each block (or, with
    ``smooth``, linearly interpolated between block centres).  Energy per scale
    falls geometrically, as in a 1/f-like (natural-signal) spectrum.
    """
    g = torch.Generator().manual_seed(seed)
    feats = []
    for s in range(scales):
        n = -(-T // 2**s)
        Z = torch.randn(n + 1, rank, generator=g, dtype=dtype)
        if smooth and s > 0:
            t = (torch.arange(T, dtype=dtype) + 0.5) / 2**s - 0.5
            t0 = t.floor().clamp(min=0, max=n - 1).long()
            frac = (t - t0).clamp(0, 1).unsqueeze(-1)
            Zs = Z[t0] * (1 - frac) + Z[t0 + 1] * frac
        else:
            Zs = Z[:n].repeat_interleave(2**s, dim=0)
        feats.append(decay**s * Zs[:T])
    X = torch.cat(feats, dim=1)
    return X @ X.T


def approximation_error_curve(T: int = 256, *, rank: int = 4, max_levels: int = 6, scales: int = 8,
                              decay: float = 0.5, smooth: bool = False, seeds: Sequence[int] = (0,),
                              sweeps: int = 10) -> Dict[str, list]:
    """Relative error of the best L-level HKT score model, L = 1 .. max_levels (Thm 4.3 / Prop 4.4).

    For each seed, A = :func:`multiscale_kernel` and the error is
    ||A - best_level_fit(A, L, rank)||_F / ||A||_F.  A single level of head dim
    ``rank`` cannot hold the rank * scales directions of multi-scale data;
    each added level captures the next coarser scale at a quarter of the
    previous level's score cost, so the error falls roughly like decay^(2L)
    (energy per scale ~ decay^(2s)) while the cost stays below 4/3.

    Returns:
        {"levels": [1..max_levels], "error": mean relative error per L,
         "error_per_seed": [[...] per seed], "cost_ratio": [cost_ratio(L)],
         "rate": geometric mean of error[L+1] / error[L], "config": {...}}.
    """
    if max_levels < 1:
        raise ValueError(f"max_levels: must be >= 1, got {max_levels}")
    kernels = [multiscale_kernel(T, rank=rank, scales=scales, decay=decay, smooth=smooth, seed=seed)
               for seed in seeds]
    c = kernel_approximation_curve(kernels, rank=rank, max_levels=max_levels, sweeps=sweeps)
    return {"levels": c["levels"], "error": c["error"], "error_per_seed": c["error_per_kernel"],
            "cost_ratio": c["cost_ratio"], "rate": c["rate"],
            "config": {"T": T, "rank": rank, "scales": scales, "decay": decay, "smooth": smooth,
                       "seeds": list(seeds), "sweeps": sweeps}}


def kernel_approximation_curve(kernels: Sequence[Tensor], *, rank: int, max_levels: int = 6,
                               sweeps: int = 10) -> Dict[str, list]:
    """Thm 4.3's error curve for given kernel matrices, e.g. X X^T of a trained
    model's own activations (research.trained_analysis) instead of
    :func:`multiscale_kernel`'s synthetic data.

    For each A (n, n) (sizes may differ) the error of L levels is
    ||A - best_level_fit(A, L, rank)||_F / ||A||_F, L = 1 .. max_levels, or
    the error of fewer levels where that is smaller: an L-level model holds any
    model of fewer levels (its other levels zero), so the best L-level error
    never rises with L, but the backfitting of more levels can stall above it
    (an exactly 3-level matrix: 0.0134 at L=3, 0.0143 at L=4, 10 sweeps).

    Returns:
        {"levels": [1..max_levels], "error": mean relative error per L,
         "error_per_kernel": [[...] per kernel], "cost_ratio": [cost_ratio(L)],
         "rate": geometric mean of error[L+1] / error[L] (nan if undefined)}.
    """
    if isinstance(max_levels, bool) or not isinstance(max_levels, int) or max_levels < 1:
        raise ValueError(f"max_levels: must be an int >= 1, got {max_levels!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank: must be an int >= 1, got {rank!r}")
    if len(kernels) == 0:
        raise ValueError("kernels: expected at least one matrix")
    per_kernel = []
    for i, A in enumerate(kernels):
        if not isinstance(A, Tensor) or A.dim() != 2 or A.shape[0] != A.shape[1]:
            raise ValueError(f"kernels: item {i} is not a square matrix: {getattr(A, 'shape', type(A).__name__)}")
        nrm = torch.linalg.norm(A)
        if not nrm > 0:
            raise ValueError(f"kernels: item {i} has Frobenius norm {float(nrm)}, the relative error is undefined")
        errs = [float(torch.linalg.norm(A - best_level_fit(A, L, rank, sweeps=sweeps)) / nrm)
                for L in range(1, max_levels + 1)]
        per_kernel.append([min(errs[:L]) for L in range(1, max_levels + 1)])
    err = [sum(e[i] for e in per_kernel) / len(per_kernel) for i in range(max_levels)]
    ratios = [err[i + 1] / err[i] for i in range(max_levels - 1) if err[i] > 0 and err[i + 1] > 0]
    rate = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else float("nan")
    return {"levels": list(range(1, max_levels + 1)), "error": err, "error_per_kernel": per_kernel,
            "cost_ratio": [cost_ratio(L) for L in range(1, max_levels + 1)], "rate": rate}


def plot_approximation_error(curves: Union[Dict[str, list], Dict[str, Dict[str, list]]], path: str, *,
                             title: str = "Best L-level HKT score model on multi-scale data") -> str:
    """Saves a log-scale plot of error against L (one line per curve) to ``path`` (PNG).

    Args:
        curves: one result of :func:`approximation_error_curve`, or a dict
            label -> result.
        path: output file.
        title: of the axes (the default names the synthetic data of
            :func:`approximation_error_curve`).

    Returns:
        ``path``.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "levels" in curves:
        curves = {"": curves}
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, c in curves.items():
        ax.semilogy(c["levels"], c["error"], marker="o", label=f"{label} (rate {c['rate']:.2f}/level)".strip())
    ax.set_xlabel("levels L")
    ax.set_ylabel("relative Frobenius error")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
