"""HKT attention through torch's scaled_dot_product_attention (the "sdpa" backend).

The HKT score is one dot product of concatenated vectors:

    score[i, j] = scale * sum_l w[l] <q[l][i >> l], k[l][j >> l]>
                = scale * <Q~[i], K~[j]>,   Q~[i] = concat_l(w[l] q[l][i >> l]),
                                            K~[j] = concat_l(k[l][j >> l])

so SDPA on Q~ (B, H, T, L*D), K~ (B, H_kv, S, L*D) and v, with the score scale of D
(not of L*D), computes it, and autograd carries the gradients back through the
concatenation to every q[l], k[l] and w.  It spends L times the score work of
one attention (the kernels spend sum 4^-l), but runs on whatever SDPA runs on
(FlashAttention, memory-efficient or cuDNN kernels on a GPU, in the inputs'
dtype).  Each row of Q~ and K~ is a repeat of a coarse row, built with expand +
reshape, whose backward is a plain sum (deterministic).

Differences from plain SDPA that hkt's contract fixes here:

- ``is_causal`` together with ``attn_mask``: one combined mask (SDPA refuses
  both at once);
- a query row with no visible key gives zeros and zero gradients: such rows
  are given an all-visible mask row (finite scores, so nothing becomes NaN in
  SDPA's forward or backward) and their output is then set to 0, which also
  zeroes every gradient that flows through them;
- ``is_causal`` with a scale <= 0 (hkt allows any finite scale): the causal
  mask goes to SDPA as a mask, not as ``is_causal``, with which torch 2.13's
  CPU kernel gave NaN rows for finite inputs;
- dropout is refused: SDPA draws its own dropout pattern, not the kernels'
  (hkt_dropout.h), so the two backends would differ.

One rule of the contract (docs/contract.md section 1.9) is SDPA's here, not
hkt's: a NaN or inf in q, k, w or v may also reach rows in which it is hidden,
because SDPA hides an entry by adding -inf to its score (-inf + NaN is NaN) and
multiplies a zero probability by v.

No data-dependent branch: the fix-up is applied unconditionally (masked_fill
with a mask that is usually all False), so this traces under torch.compile and
can be captured in a CUDA graph.

Variants: how Q~, K~ and v are handed to SDPA (``variant``, below):

- ``"concat"``: as they are, Q~ and K~ of head size L*D against v of Dv.  SDPA
  picks its kernel; on CUDA FlashAttention refuses unequal head sizes, so with
  Dv != L*D this runs on the memory-efficient kernel (or the math one).
- ``"pad_v"``: the narrower side zero-padded to the wider head size (v to L*D,
  or Q~ and K~ to Dv, which leaves every score as it is), the output sliced
  back to Dv.  Equal head sizes let FlashAttention take it, at the cost of
  L*D/Dv times the P.V work (3x at D = Dv, L = 3); the padding's gradient is
  sliced away by autograd.

``variant`` is this module's attribute (``hkt.ops.sdpa.variant = "pad_v"``),
initialised from the environment variable ``HKT_SDPA_VARIANT`` at import:
``"concat"``, ``"pad_v"`` or ``"auto"`` (the default).  ``"auto"`` takes the
variant that ``MEASURED_FASTEST`` records for the call's device, dtype and
mode (forward, or forward+backward), and ``"concat"`` where nothing is
recorded.  benchmarks/gpu_session.sh times every variant and writes the
fastest under ``"sdpa_fastest_variant"`` in its gpu.json, keyed the same way
(``variant_key``); ``MEASURED_FASTEST`` is copied from a committed
benchmarks/results/gpu.json, and tests/research/test_gpu_session.py checks that the
two agree.
"""
import os
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core.maths import band_seen, default_scale, float_mask_in, repeat_kv

__all__ = ["sdpa_attention", "concat_levels"]

VARIANTS = ("concat", "pad_v")
variant = os.environ.get("HKT_SDPA_VARIANT", "auto")

# variant_key(...) -> the fastest variant there, as measured by
# benchmarks/gpu_session.sh (its gpu.json's "sdpa_fastest_variant"); empty
# until a GPU run has been committed, so "auto" is "concat" everywhere
MEASURED_FASTEST: dict = {}

# SDPA's enable_gqa is torch 2.5's; before, the kv heads are repeated (a copy)
_SDPA_TAKES_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def _sdpa(qt: Tensor, kt: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: float) -> Tensor:
    """F.scaled_dot_product_attention, kt and v with H_kv <= H heads (grouped-query:
    query head h reads kv head h // (H // H_kv), as the kernels do)."""
    H = qt.shape[1]
    if kt.shape[1] != H and not _SDPA_TAKES_GQA:
        kt, v = repeat_kv(kt, H), repeat_kv(v, H)
    if _SDPA_TAKES_GQA:
        return F.scaled_dot_product_attention(qt, kt, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=kt.shape[1] != H)
    return F.scaled_dot_product_attention(qt, kt, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


_CUDA_NAMES: dict = {}  # device index -> "cuda sm_XY" (a plain dict: dynamo warns of lru_cache)


def _device_name(device: torch.device) -> str:
    """"cpu", or "cuda sm_90" (its compute capability): what the measurement's
    key names, since the variant's speed depends on the kernels SDPA has for it."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _CUDA_NAMES.get(index)
    if name is None:
        major, minor = torch.cuda.get_device_capability(index)
        name = _CUDA_NAMES[index] = f"cuda sm_{major}{minor}"
    return name


def variant_key(device: torch.device, dtype: torch.dtype, backward: bool) -> str:
    """The key of MEASURED_FASTEST, e.g. "cuda sm_90 bfloat16 forward+backward"."""
    return f"{_device_name(device)} {str(dtype)[6:]} {'forward+backward' if backward else 'forward'}"


def _pick_variant(qt: Tensor, v: Tensor) -> str:
    chosen = variant
    if chosen == "auto":
        if not MEASURED_FASTEST:
            return "concat"
        backward = torch.is_grad_enabled() and (qt.requires_grad or v.requires_grad)
        chosen = MEASURED_FASTEST.get(variant_key(qt.device, qt.dtype, backward), "concat")
    if chosen not in VARIANTS:
        raise ValueError(f"hkt.ops.sdpa.variant (or HKT_SDPA_VARIANT): expected 'auto' or one of {VARIANTS}, "
                         f"got {chosen!r}")
    return chosen


def _equal_head_sizes(qt: Tensor, kt: Tensor, v: Tensor):
    """(Q~, K~, v) zero-padded to one head size (zeros in Q~ and K~ add nothing
    to a score; zero columns of v give output columns sliced away)."""
    n, dv = qt.shape[-1], v.shape[-1]
    if dv < n:
        v = F.pad(v, (0, n - dv))
    elif n < dv:
        qt, kt = F.pad(qt, (0, dv - n)), F.pad(kt, (0, dv - n))
    return qt, kt, v



def _repeat_rows(x: Tensor, l: int, n: int) -> Tensor:
    """(B, H, ceil(n/2^l), D) -> (B, H, n, D), row i = x[..., i >> l, :]."""
    if l == 0:
        return x
    B, H, m, D = x.shape
    return x.unsqueeze(3).expand(B, H, m, 1 << l, D).reshape(B, H, m << l, D)[:, :, :n]


def concat_levels(q: Sequence[Tensor], k: Sequence[Tensor], w: Tensor):
    """(Q~, K~): the concatenated query and key vectors whose plain dot product is
    sum_l w[l] <q[l][i >> l], k[l][j >> l]> (w (L,) or (H, L), folded into Q~)."""
    T, S = q[0].shape[2], k[0].shape[2]
    H = q[0].shape[1]
    qs, ks = [], []
    for l in range(len(q)):
        wl = w[l] if w.dim() == 1 else w[:, l].reshape(1, H, 1, 1)
        qs.append(_repeat_rows(q[l] * wl, l, T))
        ks.append(_repeat_rows(k[l], l, S))
    return torch.cat(qs, dim=-1), torch.cat(ks, dim=-1)


def sdpa_attention(q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor, attn_mask: Optional[Tensor],
                   is_causal: bool, scale: Optional[float], sliding_window: Optional[int] = None) -> Tensor:
    """HKT attention (no dropout) through F.scaled_dot_product_attention.
    attn_mask is None or 4-D (each dimension 1 or full), bool or floating;
    sliding_window None or W >= 1, the band going to SDPA as a bool mask
    combined with causality and attn_mask; arguments already checked
    (hkt._core.checks.check_call)."""
    T, D = q[0].shape[2], q[0].shape[3]
    S = k[0].shape[2]
    if scale is None:
        scale = default_scale(D)
    qt, kt = concat_levels(q, k, w)
    Dv = v.shape[-1]
    if _pick_variant(qt, v) == "pad_v":
        qt, kt, v = _equal_head_sizes(qt, kt, v)
    scale = float(scale)
    if attn_mask is None and sliding_window is None and (not is_causal or scale > 0):
        # is_causal alone leaves no row empty (row i sees key 0) unless S == 0,
        # where SDPA gives zeros
        out = _sdpa(qt, kt, v, None, is_causal, scale)
        return out[..., :Dv] if out.shape[-1] != Dv else out
    if attn_mask is None:
        # is_causal with a scale <= 0: torch 2.13's CPU kernel for is_causal gives
        # NaN rows there (finite inputs, Dv = L * D); with an explicit mask it is
        # right, so the causal mask goes as one
        attn_mask = torch.ones((1, 1, T, S), dtype=torch.bool, device=qt.device)
    causal = None  # what causality and the band let through, (T, S)
    if is_causal:
        causal = torch.ones(T, S, dtype=torch.bool, device=qt.device).tril()
    if sliding_window is not None:
        band = band_seen(sliding_window, is_causal, T, S, qt.device)
        causal = band if causal is None else causal & band
    if attn_mask.dtype == torch.bool:
        visible = attn_mask if causal is None else attn_mask & causal
        empty = ~visible.any(dim=-1, keepdim=True)
        mask = visible | empty
    else:
        mask = float_mask_in(attn_mask, qt.dtype)
        if causal is not None:
            mask = mask.masked_fill(~causal, float("-inf"))
        # NaN is visible (it makes its row NaN, as in the kernels)
        empty = (mask == float("-inf")).all(dim=-1, keepdim=True)
        mask = mask.masked_fill(empty, 0.0)
    out = _sdpa(qt, kt, v, mask, False, scale)
    if out.shape[-1] != Dv:
        out = out[..., :Dv]
    return out.masked_fill(empty, 0.0)
