"""The nn.Module: hkt.MultiheadHKT, a drop-in nn.MultiheadAttention, and
hkt.swap_attention, which puts it into an existing model.

Shapes below: B batch, T query length, S key length, E embed_dim, H heads,
hd = E / H, L levels, K downsample_kernel.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ..ops.attention import heads as _heads
from ..ops.route import scripted_attention
from .._core.checks import check_windows
from .._core.guards import _symbolic
from .._core.maths import masked_probs, probs_of_scores, windowed_scores
from ._mha_inputs import batch_first_view, build_mask, merge_masks, packed_attention, padding_rows
from ._mha_weights import _RECOMPUTING_HOOKS, _from_mha, _stored
from ..functional import hkt_attention, qkv_attention
from ..decoding.level_cache import LevelCache
from ._mha_levels import MHALevels

__all__ = ["MultiheadHKT", "swap_attention"]


@torch.jit.unused
def _refuse_fx_proxy(query) -> None:
    """torch.fx.symbolic_trace traces into every module outside torch.nn (it
    keeps nn.MultiheadAttention whole), and this forward branches on shapes and
    values, which it cannot record: say how to keep the module whole instead of
    failing on the first branch."""
    if isinstance(query, torch.fx.Proxy):
        raise TypeError("query: torch.fx.symbolic_trace cannot trace into MultiheadHKT (its forward branches on "
                        "shapes and values); keep it whole with a tracer whose is_leaf_module(m, name) returns True "
                        "for it, as torch.fx does for nn.MultiheadAttention, or use torch.export")


def _one_input(a: Tensor, b: Tensor) -> bool:
    """Whether a and b are the same input: the same object, or, in eager mode
    and TorchScript, the same memory read the same way (Tensor.is_set_to).  A
    reentrant torch.utils.checkpoint (each argument detached on its own) and a
    full backward hook (each argument through an identity Function) hand the
    module such stand-ins for one tensor passed three times, and self-attention
    must stay self-attention there (pack_padding's zeros).  torch.compile and
    torch.func cannot evaluate is_set_to, and meta tensors have no kernel for
    it: only the object counts there.  is_set_to ignores the dtype (a float16
    tensor and its bfloat16 view), so that is compared too."""
    if a is b:
        return True
    if a.is_meta or a.dtype != b.dtype:
        return False
    if not torch.jit.is_scripting():
        if _symbolic():
            return False
    return a.is_set_to(b)


def _attention_weights(qs: List[Tensor], ks: List[Tensor], w: Tensor, mask: Optional[Tensor], causal: bool,
                       real: Optional[Tensor], average: bool, dtype: torch.dtype,
                       probs: Optional[Tensor] = None) -> Tensor:
    """MultiheadHKT's returned weights: the combined HKT probabilities, in plain
    torch (O(T*S) memory, as MHA's weights), (B, T, S') averaged over heads or
    (B, H, T, S'); with pack_padding (real, (B, T)) zero at padded query rows.
    probs: the windowed module's, computed by its own definition."""
    if probs is None:
        probs = masked_probs(qs, ks, w, mask, causal, None)
    if real is not None:
        B, T = real.shape[0], real.shape[1]
        probs = probs.masked_fill(~real.view(B, 1, T, 1), 0.0)
    weights = probs.mean(dim=1) if average else probs
    if weights.dtype != dtype:  # under autocast: the projections' dtype, as MHA's weights (w stays float32)
        weights = weights.to(dtype)
    return weights


class MultiheadHKT(MHALevels):
    r"""Multi-head Hierarchical Kernel Transformer attention, a drop-in
    replacement for :class:`torch.nn.MultiheadAttention`.

    Constructor, ``forward`` arguments, mask conventions (bool mask: True = NOT
    allowed; float mask: added), batched and unbatched shapes and return values
    are those of ``nn.MultiheadAttention``.  The attention itself is
    :func:`hkt.hkt_attention` with ``L = levels``:

    * level 0 is standard multi-head attention: ``in_proj_weight`` /
      ``in_proj_bias`` (or ``q_proj_weight``, ``k_proj_weight``,
      ``v_proj_weight`` when ``kdim`` or ``vdim`` differ from ``embed_dim``),
      ``bias_k``, ``bias_v`` and ``out_proj`` carry MHA's names and shapes, so
      an MHA ``state_dict`` loads into ``levels=1`` with ``strict=True`` and
      ``levels=1`` computes MHA's function (equal within rounding);
    * levels l >= 1, the level weights and the ``windows`` are those of
      :class:`hkt.Levels`, in the layout of the streams' projections
      (``hkt.nn._mha_levels.MHALevels``, which this class extends; their
      parameters keep their names here: ``q_downsample``, ``k_downsample``,
      ``coarse_q_proj_weight`` / ``_bias``, ``coarse_k_proj_weight`` /
      ``_bias``, ``level_logits``).  Values stay at full resolution (level
      0's value projection only).

    ``num_kv_heads`` (default ``num_heads``) gives grouped-query attention:
    keys and values get ``num_kv_heads`` heads of ``head_dim`` features
    (``num_kv_heads * head_dim = kv_dim`` outputs of every key and value
    projection, level 0's and the coarse ones; ``in_proj_weight`` is then
    (embed_dim + 2 kv_dim, embed_dim)) and query head h reads kv head
    ``h // (num_heads // num_kv_heads)``, with no copies (the kernels index
    the shared heads).  ``num_kv_heads=1`` is multi-query attention.  Only the
    default has nn.MultiheadAttention's parameter shapes.

    ``add_bias_kv`` / ``add_zero_attn`` append one key/value slot each to level
    0 exactly as MHA does (S' = S + 1 or S + 2).  For the coarse levels the key
    stream's *input* is extended by the same number of zero tokens before
    downsampling, so level l has ceil(S' / 2^l) keys as the op requires, every
    real key's coarse features are unchanged (the slots come after them and the
    downsampling is causal), and a coarse block made only of appended slots gets
    the projection bias alone.  Appended slots are visible to every query, as in
    MHA, also under ``is_causal`` (MHA pads its causal mask with an allowed
    column).

    ``pack_padding=True`` (also a settable attribute) skips the padding of
    right-padded batches: a self-attention call (``query is key is value``,
    or, outside torch.compile and torch.func, the same memory read alike, as
    a reentrant checkpoint or a backward hook passes them) with a
    ``key_padding_mask`` whose padding is at the end of every sequence (else
    ``ValueError`` naming ``key_padding_mask``) computes only the real tokens,
    packed, with :func:`hkt.hkt_attention_varlen`.  Padded query positions
    then output zeros (and get zero weights), where MHA lets them attend to
    the real keys.  Where the packed call cannot run, the padded computation
    runs with the same zeros (hkt/nn/_mha_inputs.py and docs/guide.md say where).

    ``windows``: see :class:`hkt.Levels`.  ``pack_padding`` is refused with
    windows (``ValueError``); :meth:`decode` takes them.

    Differences from ``nn.MultiheadAttention``:

    * ``is_causal=True`` applies causal masking (key j visible to query i only
      when j <= i), combined with ``attn_mask`` if given; MHA treats it as a
      hint that ``attn_mask`` is causal and requires the mask.
    * The returned weights are the combined HKT probabilities *before*
      dropout; MHA returns them after dropout (the same in eval mode).  The
      output always comes from :func:`hkt.hkt_attention`; ``need_weights=True``
      additionally materialises the (B, H, T, S) probabilities in plain torch,
      so pass ``need_weights=False`` when you do not need them.
    * A query row whose keys are all masked gives zeros, not NaN.
    * float32, float64 and bfloat16 (those of :func:`hkt.hkt_attention`);
      float16 raises ``TypeError``, except under ``torch.autocast``, where
      the attention runs in float32.
    * Malformed input raises an error naming the argument.  Where MHA
      (torch 2.13) raises ``AssertionError`` for a shape (a 2-D ``attn_mask``
      of the wrong shape: ``RuntimeError``), hkt raises ``ShapeError``
      (``hkt.functional.ShapeError``), which is both a ``ValueError`` and an
      ``AssertionError``, so code catching either works, and ``python -O``
      keeps the check:

      - ``ShapeError``: ``query`` not 2-D or 3-D; ``key`` / ``value`` of another
        rank than ``query``; feature sizes other than ``embed_dim`` / ``kdim`` /
        ``vdim``; ``key`` and ``value`` (or ``query``) with different batch
        or length; ``key_padding_mask`` or ``attn_mask`` of the wrong rank or
        shape; nested tensors; ``embed_dim`` not divisible by ``num_heads``
        (constructor).
      - ``TypeError``: an ``attn_mask`` or ``key_padding_mask`` neither bool
        nor floating point.

      Under TorchScript the same checks raise ``torch.jit.Error`` with the
      same message (TorchScript has one exception type, and prints a dtype as
      its number).
    * It is scriptable (``torch.jit.script``, alone or inside
      ``nn.TransformerEncoder`` / ``Decoder`` layers; a saved script needs
      ``import hkt`` before ``torch.jit.load`` to register the op) and
      exportable (``torch.export.export``); an exported program with a
      dynamic sequence length runs at any length above ``2 ** (levels - 1)``
      with ``torch.export.Dim.AUTO``, and at multiples of ``2 ** (levels - 1)``
      with an explicit ``Dim``.  ``merge_masks`` exists only because a scripted
      ``nn.TransformerEncoderLayer`` compiles a call to it.
    * ``_qkv_same_embed_dim`` is always False (the packed-projection flag is
      ``_packed_in_proj``): ``nn.TransformerEncoderLayer`` /
      ``nn.TransformerEncoder`` read it to decide on their fused fast path,
      which would silently compute plain MHA from ``in_proj_weight``; False is
      the documented way (a module with kdim != embed_dim) to turn it off.
    """

    # (the docstring's last point) a TorchScript constant, so that a scripted encoder layer reads it too
    _qkv_same_embed_dim = False
    __constants__ = ["_qkv_same_embed_dim"]
    __jit_ignored_attributes__ = ["windows"]

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device=None, dtype=None, *,
                 levels: int = 3, downsample_kernel: int = 2, num_kv_heads: Optional[int] = None,
                 pack_padding: bool = False, windows: Optional[Sequence[Optional[int]]] = None) -> None:
        num_kv_heads = MHALevels._check_options(embed_dim, num_heads, num_kv_heads, levels, downsample_kernel)
        windows = check_windows(windows, levels, growing=True)  # docs/contract.md section 1.11
        factory_kwargs = {"device": device, "dtype": dtype}
        kdim = kdim if kdim is not None else embed_dim
        super().__init__(num_heads, embed_dim // num_heads, num_kv_heads, levels, downsample_kernel, windows,
                         embed_dim, kdim, bias, **factory_kwargs)
        self.embed_dim = embed_dim
        self.kdim = kdim
        self.vdim = vdim if vdim is not None else embed_dim
        self._packed_in_proj = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout = dropout
        self.batch_first = batch_first
        # features of one key or value projection: num_kv_heads heads of head_dim
        Ekv = self.kv_dim = num_kv_heads * self.head_dim
        self.add_zero_attn = add_zero_attn
        self.pack_padding = bool(pack_padding)

        # Level 0: nn.MultiheadAttention's parameters, names and shapes.
        if self._packed_in_proj:
            self.in_proj_weight = nn.Parameter(torch.empty((embed_dim + 2 * Ekv, embed_dim), **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty((Ekv, self.kdim), **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty((Ekv, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * Ekv, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory_kwargs)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, Ekv), **factory_kwargs))
            self.bias_v = nn.Parameter(torch.empty((1, 1, Ekv), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None

        # Levels 1 .. L-1, after level 0: the order of parameters() (and of optimiser state)
        self._add_coarse_levels(**factory_kwargs)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """Init for training from scratch.  Level 0 as nn.MultiheadAttention
        (xavier_uniform projections, zero biases, xavier_normal bias_k/v),
        then the levels as :meth:`Levels._reset_levels`."""
        if self._packed_in_proj:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_v)
        self._reset_levels()

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}", f"levels={self.levels}",
                 f"downsample_kernel={self.downsample_kernel}"]
        optional = [(self.num_kv_heads != self.num_heads, f"num_kv_heads={self.num_kv_heads}"),
                    (self.kdim != self.embed_dim or self.vdim != self.embed_dim, f"kdim={self.kdim}, vdim={self.vdim}"),
                    (bool(self.dropout), f"dropout={self.dropout}"),
                    (self.windows is not None, f"windows={list(self.windows or ())}"),
                    (self.bias_k is not None, "add_bias_kv=True"), (self.add_zero_attn, "add_zero_attn=True"),
                    (self.batch_first, "batch_first=True")]
        return ", ".join(parts + [text for shown, text in optional if shown])

    @torch.jit.unused
    def _windowed_probs(self, qs: List[Tensor], ks: List[Tensor], w: Tensor, mask: Optional[Tensor],
                        causal: bool) -> Tensor:
        """need_weights with windows: the dense definition's probabilities (O(T*S), as MHA's weights)."""
        return probs_of_scores(*windowed_scores(qs, ks, w, self.windows), mask, causal)

    @torch.jit.unused
    def _stored_weight(self) -> Tensor:
        """A parameter in the module's dtype and on its device: ``out_proj.weight``
        as stored, read without computing a parametrization on it (forward
        computes it once, in ``out_proj``, as nn.MultiheadAttention does)."""
        return _stored(self.out_proj, "weight")

    def in_projections(self) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """Level 0's ``(W_q, W_k, W_v, b_q, b_k, b_v)``: views of
        ``in_proj_weight`` / ``in_proj_bias`` (or the separate
        ``q/k/v_proj_weight``), so writing into them sets the parameters;
        biases None without ``bias``."""
        return self._split_in_proj(self.in_proj_weight, self.in_proj_bias)

    def _split_in_proj(self, packed: Optional[Tensor], bias: Optional[Tensor]
                       ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """in_projections() of ``in_proj_weight`` and ``in_proj_bias`` read once
        by the caller (a parametrization computes them on every read)."""
        # written with `is None` tests (not _packed_in_proj) so that TorchScript
        # refines the Optional parameters and drops the branch for those this module lacks
        E, Ekv = self.embed_dim, self.kv_dim
        if packed is not None:
            wq, wk, wv = packed[:E], packed[E:E + Ekv], packed[E + Ekv:]
        else:
            q_w, k_w, v_w = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
            if q_w is None or k_w is None or v_w is None:
                raise RuntimeError("MultiheadHKT has neither in_proj_weight nor q/k/v_proj_weight")
            wq, wk, wv = q_w, k_w, v_w
        bq: Optional[Tensor] = None
        bk: Optional[Tensor] = None
        bv: Optional[Tensor] = None
        if bias is not None:
            bq, bk, bv = bias[:E], bias[E:E + Ekv], bias[E + Ekv:]
        return wq, wk, wv, bq, bk, bv

    def level_projections(self) -> List[Tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor]]]:
        """Per level l, ``(W_q, b_q, W_k, b_k)``: the query projection
        (embed_dim, embed_dim) and key projection (kv_dim, kdim), torch layout,
        that level l applies to its inputs (:meth:`level_inputs`); level 0's
        are slices of ``in_proj_weight`` / ``in_proj_bias`` (or the separate
        ``q_proj_weight`` and ``k_proj_weight``).  Biases are None without
        ``bias``.  The one place that says which parameter serves which level:
        ``forward``, incremental decoding and :mod:`hkt.analysis` read it."""
        wq, wk, _, bq, bk, _ = self.in_projections()
        return [(wq, bq, wk, bk)] + self.coarse_projections()

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention, levels: int = 3, downsample_kernel: int = 2, *,
                 level0_weight: float = 0.5, windows: Optional[Sequence[Optional[int]]] = None) -> "MultiheadHKT":
        """A MultiheadHKT whose output equals ``mha``'s (to float rounding) before any training.

        Same options, device, dtype and training mode as ``mha``; level 0 gets a
        copy of ``mha``'s parameters, each requiring grad as its source does;
        the parameters hkt adds (coarse projections, taps, level weights)
        require grad if any of ``mha``'s does (a frozen attention stays
        frozen).  A weight that ``mha`` computes (a parametrization of
        torch.nn.utils.parametrize: weight_norm, spectral_norm, orthogonal,
        torch.ao's pruning; or torch.nn.utils' pre-hooks: prune, the old
        weight_norm) is copied as its current value into a plain parameter that
        requires grad as what it is computed from does; the parametrization or
        hook does not carry over (nor do any other hooks of ``mha``), so its
        constraint (a weight norm, orthogonality, a pruning mask) no longer
        holds in training: a ``UserWarning`` names each such weight.  The
        coarse levels start switched off but trainable, as :class:`hkt.Levels`
        says under "A trained attention's start" (``level0_weight``: w0 there).

        With ``levels=1`` the result is an exact copy of ``mha``.

        Load a pretrained ``nn.MultiheadAttention`` state_dict into ``mha``
        before: loaded into the result (``strict=False`` for ``levels > 1``) it
        would undo the 1/w0 scaling and leave the coarse keys copied from the
        old key projection, another function than the checkpoint's
        (``levels=1`` takes it unchanged).

        Args:
            mha: the source ``nn.MultiheadAttention`` (not modified).
            levels, downsample_kernel: as in the constructor.
            level0_weight: w0 in (0, 1), default 0.5; ignored when levels == 1.

        Raises:
            TypeError if ``mha`` is not an ``nn.MultiheadAttention``, or is a
            subclass with its own ``forward``, which may compute with other
            weights than those copied (torch.ao's quantizable
            MultiheadAttention, which ``torch.ao.quantization.prepare`` makes,
            computes with ``linear_Q/K/V``); ValueError for ``level0_weight``
            outside (0, 1).
        """
        return _from_mha(cls, mha, levels, downsample_kernel, level0_weight, windows)

    def merge_masks(self, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                    query: Tensor) -> Tuple[Optional[Tensor], Optional[int]]:
        """As ``nn.MultiheadAttention.merge_masks`` (hkt.nn._mha_inputs.merge_masks)."""
        return merge_masks(self.num_heads, attn_mask, key_padding_mask, query)

    def _project(self, query: Tensor, key: Tensor, value: Tensor
                 ) -> Tuple[List[Tensor], List[Tensor], Tensor, Optional[Tensor], int]:
        """forward's projections of its batch-first (B, T, E), (B, S, kdim),
        (B, S, vdim) inputs: (q per level (B, H, ceil(T/2^l), hd), k per level
        (B, H_kv, ceil(S'/2^l), hd), v (B, H_kv, S', hd), the packed
        self-attention projection qkv (B, T, E + 2 kv_dim) or None, n_extra:
        the key slots add_bias_kv / add_zero_attn appended, S' = S + n_extra)."""
        B, E = query.shape[0], query.shape[2]
        H, hd = self.num_heads, self.head_dim

        # each parameter read once: a parametrization on it is computed once per call
        packed, in_bias = self.in_proj_weight, self.in_proj_bias
        wq, wk, wv, bq, bk, bv = self._split_in_proj(packed, in_bias)
        Hk, Ekv = self.num_kv_heads, self.kv_dim
        qkv: Optional[Tensor] = None
        if packed is not None and query is key and key is value:
            qkv = F.linear(query, packed, in_bias)
            q0, k0, v = qkv.split([E, Ekv, Ekv], dim=-1)
        else:
            q0, k0, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

        n_extra = 0
        bias_k, bias_v = self.bias_k, self.bias_v
        if bias_k is not None and bias_v is not None:
            k0 = torch.cat([k0, bias_k.expand(B, 1, Ekv)], dim=1)
            v = torch.cat([v, bias_v.expand(B, 1, Ekv)], dim=1)
            n_extra += 1
        if self.add_zero_attn:
            k0 = torch.cat([k0, k0.new_zeros(B, 1, Ekv)], dim=1)
            v = torch.cat([v, v.new_zeros(B, 1, Ekv)], dim=1)
            n_extra += 1

        # appended slots: zero inputs of the key stream
        coarse_q, coarse_k = self.coarse_levels(query, F.pad(key, [0, 0, 0, n_extra]) if n_extra > 0 else key)
        return [_heads(q0, H, hd)] + coarse_q, [_heads(k0, Hk, hd)] + coarse_k, _heads(v, Hk, hd), qkv, n_extra

    def _attend(self, qs: List[Tensor], ks: List[Tensor], vh: Tensor, w: Tensor, qkv: Optional[Tensor],
                mask: Optional[Tensor], causal: bool, dropout_p: float, real: Optional[Tensor], n_extra: int,
                attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor]) -> Tensor:
        """The attention (B, H, T, hd) of forward's projected heads, by one of
        four ways: the registered op in TorchScript; pack_padding's packed call
        (real: its (B, S) real tokens); the packed self-attention projection's
        call, whose gradient the kernels write as qkv's; else hkt_attention."""
        if torch.jit.is_scripting():
            out = scripted_attention(qs, ks, vh, w, mask, causal, dropout_p)
        elif (real is not None and attn_mask is None and n_extra == 0 and dropout_p == 0.0
              and qs[0].device.type == "cpu" and not _symbolic()
              # the packed call never reads the mask: a float mask's gradient needs the padded one
              and not (torch.is_grad_enabled() and key_padding_mask is not None and key_padding_mask.requires_grad)):
            out = packed_attention(qs, ks, vh, w, real, causal)
        elif qkv is not None and n_extra == 0:  # dq, dk, dv written as qkv's gradient, uncopied
            out = qkv_attention(qkv, qs, ks, vh, w, mask, causal, dropout_p)
        else:
            out = hkt_attention(qs, ks, vh, w, attn_mask=mask, is_causal=causal, dropout_p=dropout_p)
        return out

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        r"""As ``nn.MultiheadAttention.forward``.

        Args:
            query: (T, E) unbatched, (T, B, E), or (B, T, E) with ``batch_first``.
            key: (S, kdim), (S, B, kdim) or (B, S, kdim).
            value: (S, vdim), (S, B, vdim) or (B, S, vdim).
            key_padding_mask: (B, S), or (S,) unbatched; bool (True = ignore
                that key) or float (added).
            need_weights: also return the attention probabilities.
            attn_mask: (T, S) or (B * num_heads, T, S) ((num_heads, T, S)
                unbatched); bool (True = NOT allowed) or float (added).
            average_attn_weights: average the returned weights over heads.
            is_causal: key j visible to query i only when j <= i (with
                ``attn_mask`` as well, if given).  Appended ``bias_k`` /
                zero-attention slots stay visible.

        Returns:
            (attn_output, attn_weights): attn_output shaped like ``query`` with
            E features; attn_weights None unless ``need_weights``, else
            (B, T, S') averaged or (B, H, T, S') per head ((T, S') / (H, T, S')
            unbatched), S' = S + [add_bias_kv] + [add_zero_attn], before dropout.

        Raises:
            ShapeError (a ValueError and an AssertionError) for malformed
            shapes (ranks, feature sizes, batch or length mismatches, mask
            shapes, nested tensors); TypeError for mask dtypes other than bool
            and floating point (``torch.jit.Error`` when scripted).
        """
        if not torch.jit.is_scripting():
            _refuse_fx_proxy(query)
        query, key, value, unbatched = batch_first_view(query, key, value, self.batch_first, self.embed_dim,
                                                        self.kdim, self.vdim)
        # Now (B, T, E), (B, S, kdim), (B, S, vdim).
        B, T, E = query.shape[0], query.shape[1], query.shape[2]
        S = key.shape[1]
        qs, ks, v, qkv, n_extra = self._project(query, key, value)
        w = self.level_weights()
        dtype = qs[0].dtype
        mask, causal = build_mask(self.num_heads, attn_mask, key_padding_mask, bool(is_causal), B, T, S, n_extra,
                                  unbatched, dtype, qs[0].device)
        dropout_p = float(self.dropout) if self.training else 0.0
        # whether the call is self-attention matters only to pack_padding
        packs = self.pack_padding and key_padding_mask is not None
        real: Optional[Tensor] = None
        if packs and key_padding_mask is not None and _one_input(query, key) and _one_input(key, value):
            real = padding_rows(key_padding_mask, B, S)
        if self._windowed:
            if torch.jit.is_scripting():
                raise RuntimeError("windows: the windowed kernels do not run under TorchScript; call the module "
                                   "unscripted")
            out = self._windowed_attention(qs, ks, v, w, mask, causal, dropout_p, packs)
        else:
            out = self._attend(qs, ks, v, w, qkv, mask, causal, dropout_p, real, n_extra, attn_mask,
                               key_padding_mask)
        out = self.out_proj(out.transpose(1, 2).reshape(B, T, E))
        if real is not None:  # pack_padding: padded query rows give zeros, whichever path ran
            out = out.masked_fill(~real.unsqueeze(-1), 0.0)

        weights: Optional[Tensor] = None
        if need_weights:
            probs = self._windowed_probs(qs, ks, w, mask, causal) if self._windowed else None
            weights = _attention_weights(qs, ks, w, mask, causal, real, average_attn_weights, dtype, probs)
        if unbatched:
            out = out.squeeze(0)
            if weights is not None:
                weights = weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def init_cache(self, batch_size: int, max_len: int, *, device=None, dtype=None) -> LevelCache:
        """A cache for :meth:`decode`: ``batch_size`` sequences of at most
        ``max_len`` tokens, empty; device, dtype default the module's (float32
        or float64 only).  See :class:`hkt.LevelCache` for what it holds and
        what raises.
        """
        LevelCache.check_module(self)
        return LevelCache.empty(self, batch_size, max_len, self._stored_weight(), device, dtype)

    def decode(self, x: Tensor, cache: LevelCache) -> Tensor:
        """Incremental causal self-attention: the output for the next ``n`` tokens
        of each sequence, given the ``cache`` of those before (from
        :meth:`init_cache`), which it advances by ``n``.  ``x``: the new
        tokens' embeddings, (B, n, E) with ``batch_first``, else (n, B, E);
        query = key = value = x.  Returns the output in the same layout, equal
        (to rounding) to the last ``n`` rows of ``self(seq, seq, seq,
        is_causal=True, need_weights=False)[0]`` over the whole sequence so
        far.  Inference only.  See :class:`hkt.LevelCache` for how it runs,
        what raises, hooks, and parameters changed between steps.
        """
        # the weights forward would read: a recomputing pre-hook may not have run
        # since they changed (prune's <name>_orig after an optimiser step)
        for hook in list(self._forward_pre_hooks.values()):
            if isinstance(hook, _RECOMPUTING_HOOKS):
                hook(self, ())
        LevelCache.check_module(self)
        if not isinstance(cache, LevelCache):
            raise TypeError(f"cache: expected the LevelCache of mha.init_cache(...), got {type(cache).__name__}")
        return cache.step(self, x, self._stored_weight().dtype)


def swap_attention(model: nn.Module, levels: int = 3, **kw) -> nn.Module:
    """Replaces every ``nn.MultiheadAttention`` inside ``model`` (recursively, in
    place) by ``MultiheadHKT.from_mha(mha, levels, **kw)``, so the model's
    output is unchanged until it trains.

    Device, dtype, training mode and which parameters require grad are kept
    (see :meth:`MultiheadHKT.from_mha`); a module shared at several places (in
    one parent or several) is replaced by one shared MultiheadHKT.  The new
    modules are new objects: hooks registered on the old ones, parametrizations
    of their weights (copied as their current values, with a ``UserWarning``)
    and an optimizer built over their parameters do not carry over (build the
    optimizer after the swap).  A subclass with its own ``forward`` (torch.ao's
    quantizable MultiheadAttention) raises from_mha's ``TypeError``, before
    anything is replaced.  Load a pretrained ``nn.MultiheadAttention``
    checkpoint before swapping, not into the swapped model (see
    :meth:`MultiheadHKT.from_mha`).  Every
    ``nn.TransformerEncoder`` that now holds a MultiheadHKT gets
    ``use_nested_tensor = False``: it chose its nested-tensor fast path at
    construction, from the old attention, and that path would hand nested
    tensors to the new one.

    Args:
        model: any module (not modified other than the replacements).
        levels: levels of the new modules.
        **kw: passed to :meth:`MultiheadHKT.from_mha` (``downsample_kernel``,
            ``level0_weight``, ``windows``).

    Returns:
        ``model``; if ``model`` itself is an ``nn.MultiheadAttention``, the new
        MultiheadHKT (it cannot be replaced in place).
    """
    if isinstance(model, nn.MultiheadAttention):
        return MultiheadHKT.from_mha(model, levels, **kw)
    done = {}
    slots = []
    for parent in list(model.modules()):
        # _modules, not named_children(), which skips a module's second slot in one parent
        for name, child in list(parent._modules.items()):
            if isinstance(child, nn.MultiheadAttention):
                if id(child) not in done:
                    done[id(child)] = MultiheadHKT.from_mha(child, levels, **kw)
                slots.append((parent, name, done[id(child)]))
    # only once every from_mha went through: one that raises leaves the model as it was
    for parent, name, new in slots:
        setattr(parent, name, new)
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder) and any(isinstance(x, MultiheadHKT) for x in m.modules()):
            m.use_nested_tensor = False
    return model
