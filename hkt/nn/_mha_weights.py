"""MultiheadHKT's dealings with weights it does not own: which of a module's
weights torch.nn.utils computes (a parametrization, or a pre-hook that
recomputes it on every call) and from what, and from_mha's copies of an
nn.MultiheadAttention's parameters into a new MultiheadHKT, with the start it
gives the coarse levels.
"""
import warnings
from typing import List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize, prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm


# torch.nn.utils' forward pre-hooks that recompute a module's tensor, on every
# call, from parameters they keep beside it (prune and spectral_norm: <name>_orig;
# the old weight_norm: <name>_g and <name>_v)
_RECOMPUTING_HOOKS = (prune.BasePruningMethod, WeightNorm, SpectralNorm)


@torch.jit.unused
def _computed_from(owner: nn.Module, name: str) -> Optional[Tuple[str, List[Tensor]]]:
    """How ``owner.<name>`` is computed when the module does not store it as a
    parameter: (what computes it, the tensors it is computed from, which are
    what trains).  A parametrization (torch.nn.utils.parametrize: weight_norm,
    spectral_norm, orthogonal, torch.ao's pruning masks) computes it from its
    originals whenever it is read; a forward pre-hook of torch.nn.utils
    (prune, the old weight_norm and spectral_norm) from the module's parameters
    named ``<name>_...``, on every call of the module.  None for a stored
    parameter."""
    if parametrize.is_parametrized(owner, name):
        plist = owner.parametrizations[name]
        return "its parametrization " + ", ".join(type(p).__name__ for p in plist), _originals(owner, name)
    if name in owner._parameters:
        return None
    for hook in owner._forward_pre_hooks.values():
        if isinstance(hook, _RECOMPUTING_HOOKS) and getattr(hook, "_tensor_name", getattr(hook, "name", None)) == name:
            sources = [p for n, p in owner._parameters.items() if p is not None and n.startswith(name + "_")]
            return f"the forward pre-hook {type(hook).__name__}", sources
    return None


@torch.jit.unused
def _originals(owner: nn.Module, name: str) -> List[Tensor]:
    """The tensors the parametrization of ``owner.<name>`` computes it from."""
    plist = owner.parametrizations[name]
    if plist.is_tensor:
        return [plist.original]
    return [getattr(plist, f"original{i}") for i in range(plist.ntensors)]


@torch.jit.unused
def _stored(owner: nn.Module, name: str) -> Tensor:
    """``owner.<name>``, or for a parametrized one its (first) original, which
    reading does not compute: for its dtype and device.  Computing a
    parametrization more than once per call costs, and changes what a stateful
    one gives (spectral_norm advances its power iteration on every read in
    training)."""
    if parametrize.is_parametrized(owner, name):
        return _originals(owner, name)[0]
    return getattr(owner, name)


def _copy_level0(new: nn.Module, mha: nn.MultiheadAttention) -> Set[int]:
    """from_mha's copies of mha's parameters into new's level 0, each training
    only if its source did; returns the ids of the copies."""
    copied = set()

    def take(dst: Tensor, owner: nn.Module, name: str) -> None:
        """dst = owner.<name>, a copy that trains only if its source did: for a
        computed weight, if what it is computed from does (read under no_grad,
        the computed value itself never requires grad)."""
        src, how = getattr(owner, name), _computed_from(owner, name)
        trains = src.requires_grad if how is None else any(t.requires_grad for t in how[1])
        if how is not None:
            path = name if owner is mha else "out_proj." + name
            warnings.warn(f"mha.{path}: is computed by {how[0]}, which does not carry over: the copy holds its "
                          "current value and trains without it, so its constraint (a weight norm, "
                          "orthogonality, a pruning mask) no longer holds", UserWarning, stacklevel=4)
        dst.copy_(src)
        dst.requires_grad_(trains)
        copied.add(id(dst))
    with torch.no_grad():
        if mha._qkv_same_embed_dim:
            if new.in_proj_weight is not None:
                take(new.in_proj_weight, mha, "in_proj_weight")
            else:  # cannot happen: same kdim/vdim; kept for safety
                raise AssertionError("packed MHA but unpacked MultiheadHKT")
        else:
            take(new.q_proj_weight, mha, "q_proj_weight")
            take(new.k_proj_weight, mha, "k_proj_weight")
            take(new.v_proj_weight, mha, "v_proj_weight")
        if mha.in_proj_bias is not None:
            take(new.in_proj_bias, mha, "in_proj_bias")
        take(new.out_proj.weight, mha.out_proj, "weight")
        if mha.out_proj.bias is not None:
            take(new.out_proj.bias, mha.out_proj, "bias")
        if mha.bias_k is not None:
            take(new.bias_k, mha, "bias_k")
            take(new.bias_v, mha, "bias_v")
    return copied


def _switch_coarse_off(new: nn.Module, level0_weight: float) -> None:
    """from_mha's start for the coarse levels (see its docstring): off, but
    trainable; level 0 rescaled so that its weight w0 leaves MHA's score."""
    with torch.no_grad():
        w0 = new._start_from_trained(level0_weight)  # (H,), in the module's dtype
        inv = (1.0 / w0).repeat_interleave(new.head_dim)  # (E,): one factor per query row
        wq, wk, _, bq, bk, _ = new.in_projections()
        wq.mul_(inv[:, None])
        if bq is not None:
            bq.mul_(inv)
        new.coarse_q_proj_weight.zero_()
        new.coarse_k_proj_weight.copy_(wk.unsqueeze(0).expand_as(new.coarse_k_proj_weight))
        if bq is not None:
            new.coarse_q_proj_bias.zero_()
            new.coarse_k_proj_bias.copy_(bk.unsqueeze(0).expand_as(new.coarse_k_proj_bias))


def _from_mha(cls, mha: nn.MultiheadAttention, levels: int, downsample_kernel: int, level0_weight: float,
              windows) -> nn.Module:
    """MultiheadHKT.from_mha (cls: the class to make)."""
    if not isinstance(mha, nn.MultiheadAttention):
        raise TypeError(f"mha: expected an nn.MultiheadAttention, got {type(mha).__name__}")
    if type(mha).forward is not nn.MultiheadAttention.forward:
        # it may compute with other weights: torch.ao's quantizable MultiheadAttention (which
        # torch.ao.quantization.prepare makes) uses linear_Q/K/V, and its in_proj_weight is unused
        kind = type(mha)
        raise TypeError(f"mha: {kind.__module__}.{kind.__qualname__} has its own forward, which from_mha cannot "
                        "copy (it may compute with other weights than nn.MultiheadAttention's, as torch.ao's "
                        "quantizable MultiheadAttention does); swap a plain nn.MultiheadAttention, e.g. before "
                        "torch.ao.quantization.prepare")
    if not 0.0 < level0_weight < 1.0:
        raise ValueError(f"level0_weight: must be in (0, 1), got {level0_weight}")
    ref = _stored(mha.out_proj, "weight")
    new = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
              add_bias_kv=mha.bias_k is not None, add_zero_attn=mha.add_zero_attn, kdim=mha.kdim,
              vdim=mha.vdim, batch_first=mha.batch_first, device=ref.device, dtype=ref.dtype,
              levels=levels, downsample_kernel=downsample_kernel, windows=windows)
    copied = _copy_level0(new, mha)
    if levels > 1:
        _switch_coarse_off(new, level0_weight)
    # what trained before trains after: the copies as their sources (above), and
    # the parameters hkt adds (coarse projections, taps, level weights) if any of
    # mha's did, so a frozen attention stays frozen
    trainable = any(p.requires_grad for p in mha.parameters())
    for p in new.parameters():
        if id(p) not in copied:
            p.requires_grad_(trainable)
    new.train(mha.training)
    return new
