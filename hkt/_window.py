"""hkt_attention(..., windows=...): its arguments checked, what the windowed
CPU kernels cannot take refused by name, and the call of their op,
hkt::window_forward (hkt/ops/window.py, which also forms the values' block
sums the kernels take).
"""
import math

import torch

from ._checks import _kernel_mask, check_call, check_windows
from ._guards import _functorch_active
from ._kernels import window_softcap
from ._maths import repeat_kv
# (tests and benchmarks name the ops and block_sums here)
from .ops.attention import SEED_HIGH
from .ops.window import _key_only, block_sums, window_backward, window_forward  # noqa: F401

__all__ = ["windowed_attention"]


def _radius(windows):
    return tuple(0 if W is None else W >> l for l, W in enumerate(windows))


def windowed_attention(q, k, v, w, windows, attn_mask, is_causal, dropout_p, scale, backend, softcap=None):
    """hkt_attention with windows: its arguments checked as hkt_attention checks
    them, what the windowed kernels cannot take refused by name; None when no
    level has a window (the caller then makes today's call).  softcap: None
    (or 0.0) for none, else c > 0 (docs/contract.md section 1.12)."""
    windows = check_windows(windows, len(q), growing=True)
    if windows is None:  # no level has a window: today's call, unchanged
        return None
    softcap = window_softcap(softcap)  # the extension's check; 0.0: none
    if backend == "sdpa":
        raise ValueError("backend: 'sdpa' does not take windows (the levels that see a pair vary with it, which no "
                         "one SDPA call expresses); use backend=None or 'kernels'")
    _, dropout_p, scale = check_call(q, k, v, w, attn_mask, is_causal, dropout_p, scale, dropout_allowed=True)
    if _functorch_active():  # whichever backend was asked for
        raise NotImplementedError("windows: the windowed kernels do not run under torch.func transforms (vmap, "
                                  "grad, jacrev, ...)")
    if q[0].device.type not in ("cpu", "meta"):  # meta: the op's fake kernel gives the shapes
        raise ValueError(f"windows: the windowed kernels run on the CPU only, got q[0] on {q[0].device}")
    dtype = q[0].dtype
    if attn_mask is not None:
        attn_mask = _kernel_mask(attn_mask, q[0], k[0])
    if scale is None:
        scale = 1.0 / math.sqrt(q[0].shape[-1])
    scale = float(scale)
    L = len(q)
    if dtype == torch.bfloat16:  # computed in float32, rounded back
        cast = [x.float().contiguous() for x in (*q, *k, v, w)]
    else:
        cast = [x.contiguous() for x in (*q, *k, v, w)]
    q, k, v, w = cast[:L], cast[L:2 * L], cast[2 * L], cast[2 * L + 1]
    H = q[0].shape[1]
    if _key_only(attn_mask, dropout_p, H) and attn_mask.shape[1] > 1 and k[0].shape[1] < H:
        # a key mask per query head over grouped kv heads: the kv heads repeated, so the
        # visible keys' sums are per query head (autograd sums their gradients back)
        k, v = [repeat_kv(x, H) for x in k], repeat_kv(v, H)
    w2 = w.expand(H, L).contiguous() if w.dim() == 1 else w  # autograd sums dw back over the heads
    seed = torch.randint(0, SEED_HIGH, (), dtype=torch.int64) if dropout_p > 0 else torch.zeros((), dtype=torch.int64)
    out = window_forward(q, k, v, w2, attn_mask, list(_radius(windows)), is_causal, scale, dropout_p, seed,
                         softcap)[0]
    return out.to(dtype) if dtype == torch.bfloat16 else out
