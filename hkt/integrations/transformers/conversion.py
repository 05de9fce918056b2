"""convert (a loaded transformers model made an HKT model, in place) and
from_pretrained (a converted model saved with save_pretrained, loaded), with
what they read: the model's attention modules and their head shapes, and
the HKT parameters of a safetensors checkpoint."""
import functools
import inspect
import json
import os
from typing import Dict, List, Optional

from torch import Tensor, nn

from hkt._core.checks import check_windows

from .attention import _note_cache, _windowed
from .levels import HKTLevels


NAME = "hkt"
# the key in model.config (and config.json) that says a model is converted, and how
CONFIG_KEY = "hkt"


def _reorder_cache(model: nn.Module, cache, beam_idx: Tensor):
    """Beam search's cache reordering (``generate`` calls ``model._reorder_cache``
    where a model has one): transformers' cache as it would be reordered
    without HKT (by the model class's own ``_reorder_cache`` where it has one),
    and every converted layer's coarse levels with it."""
    own = getattr(type(model), "_reorder_cache", None)
    if own is not None:
        cache = own(model, cache, beam_idx)
    else:
        cache.reorder_cache(beam_idx)
    for m in model.modules():
        if isinstance(m, HKTLevels) and m.decode_state is not None:
            m.decode_state.reorder(beam_idx)
    return cache


def _reads_attention_interface(cls) -> bool:
    """Whether a module class's forward looks up transformers' attention
    functions (``ALL_ATTENTION_FUNCTIONS``, the AttentionInterface): in the
    installed transformers every attention class that routes through the
    interface does so in its own ``forward``, whatever its projections are
    called (fused ones included)."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _attention_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of a transformers model that call the AttentionInterface."""
    return [m for m in model.modules() if _reads_attention_interface(type(m))]


def _first_attr(objects, names):
    for obj in objects:
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _head_shape(m: nn.Module):
    """(H, H_kv, D) of an attention module: from its own attributes where it
    has them (each family names them its own way), else from its config."""
    config = getattr(m, "config", None)
    H = _first_attr([m, config], ("num_heads", "num_attention_heads"))
    D = _first_attr([m], ("head_dim", "head_size", "attention_head_size")) or _first_attr([config], ("head_dim",))
    if D is None and H and _first_attr([config], ("hidden_size",)):
        D = config.hidden_size // H
    Hk = _first_attr([m], ("num_key_value_heads", "num_kv_heads"))
    groups = _first_attr([m], ("num_key_value_groups",))
    if Hk is None and groups and H:
        Hk = H // groups
    if Hk is None:
        Hk = _first_attr([config], ("num_key_value_heads",)) or H
    if not H or not D:
        raise ValueError(f"model: {type(m).__name__} names neither its heads nor its head size in a way HKT reads "
                         "(num_heads / num_attention_heads, head_dim / head_size, or its config's)")
    return H, Hk, D


def _check_options(levels, downsample_kernel, level0_weight) -> None:
    HKTLevels._check_levels(levels, downsample_kernel)
    if not isinstance(level0_weight, (int, float)) or isinstance(level0_weight, bool) or not 0 < level0_weight < 1:
        raise ValueError(f"level0_weight: must be in (0, 1), got {level0_weight!r}")


def convert(model: nn.Module, levels: int = 3, downsample_kernel: int = 2, *, level0_weight: float = 0.5,
            windows: Optional[List[Optional[int]]] = None) -> nn.Module:
    """Turns a loaded transformers model into an HKT model, in place, and returns it.

    Its attention modules are those whose forward calls transformers'
    AttentionInterface (whatever their projections are called: Llama's
    ``q_proj``, Phi-3's fused ``qkv_proj``, GPT-2's ``c_attn``, BERT's
    ``query``), with their head counts and head size read from the module or
    its config.  Every one gets an :class:`HKTLevels` child ``hkt`` on the
    device and in the dtype of its parameters, initialised so that the
    model computes what it computed before (levels=1 is the same attention,
    on hkt's kernels); the new parameters train if the attention's did.  The
    model's config gets ``hkt = {"levels", "downsample_kernel",
    "level0_weight"}`` (saved by ``save_pretrained``; :func:`from_pretrained`
    reads it) and attn_implementation "hkt".  Causal attention (decoders)
    becomes causal HKT; bidirectional attention (encoders, ``is_causal``
    False) non-causal HKT over each row's tokens.  A layer with a sliding
    window (Mistral's, Qwen2's, Gemma 2/3's local layers) keeps it: every
    level sees exactly the keys the model's mask lets the layer see, a mask
    over every (query, key) pair (dense cost); with levels > 1 its cache
    layer keeps every key.

    ``windows`` (None, or one entry per level: None or W_l tokens, a
    positive multiple of 2^l, growing with the level; docs/contract.md
    section 1.11) gives every converted layer per-level windows: level l sees
    only the keys whose level-l block is less than W_l / 2^l blocks from the
    query's, at near-linear cost in the sequence length on the CPU (the
    windowed kernels run there only).  Stored in ``config.hkt["windows"]``.
    It needs levels >= 2 (with one level a window is a plain sliding window
    that hides every key beyond it) and a model without sliding-window
    layers of its own.  A decoding step with the cache runs the windowed
    decoding kernel over rings filled at the prompt (CPU, float32/float64,
    no gradients; a cost bounded by the windows), elsewhere it recomputes
    the windowed op over the whole sequence (near-linear in its length).

    Raises:
        ValueError for bad options (``windows[l]`` named), a model with no
        such attention module, one already converted, (levels > 1)
        cross-attention, or windows on a model with sliding-window layers,
        each saying what to do instead;
        NotImplementedError (later) from ``generate`` with a static cache
        and levels > 1, or with assisted decoding (a cropped cache).
    """
    _check_options(levels, downsample_kernel, level0_weight)
    windows = check_windows(windows, levels, growing=True)
    if windows is not None and levels == 1:
        raise ValueError("windows: needs levels >= 2 (with one level a window is a plain sliding window that hides "
                         "every key beyond it); convert with levels >= 2, the top level without a window")
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(f"model: no attention module of transformers' AttentionInterface kind found in "
                         f"{type(model).__name__}")
    shapes = []
    for m in modules:
        name = f"{type(m).__name__} (layer {getattr(m, 'layer_idx', '?')})"
        if isinstance(getattr(m, "hkt", None), HKTLevels):
            raise ValueError("model: already converted to HKT")
        if levels > 1 and getattr(m, "is_cross_attention", False):
            raise ValueError(f"model: {name} is cross-attention, whose keys come from another sequence: HKT's "
                             "coarse levels are for self-attention; convert with levels=1")
        if windows is not None and _windowed(m) is not None:
            raise ValueError(f"windows: {name} has a sliding window of its own ({_windowed(m)} positions), which "
                             "per-level windows would replace; convert it without windows, or build it without "
                             "its sliding window")
        shapes.append(_head_shape(m))
    for m, (H, Hk, D) in zip(modules, shapes):
        ref = next(m.parameters())
        trains = any(p.requires_grad for p in m.parameters())
        m.hkt = HKTLevels(H, Hk, D, levels, downsample_kernel, level0_weight, windows=windows, device=ref.device,
                          dtype=ref.dtype)
        m.hkt.requires_grad_(trains)
        m.register_forward_pre_hook(_note_cache, with_kwargs=True)
    model.config.hkt = {"levels": levels, "downsample_kernel": downsample_kernel, "level0_weight": level0_weight}
    if windows is not None:  # only then: a conversion without windows keeps the config it always had
        model.config.hkt["windows"] = list(windows)
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise ValueError(f"model: {type(model).__name__} does not take a registered attention implementation")
    # generate's beam search asks the model first, then the cache
    model._reorder_cache = functools.partial(_reorder_cache, model)
    return model


def _checkpoint_tensors(path: str, wanted: List[str]) -> Dict[str, Tensor]:
    """The tensors named ``wanted`` from the safetensors checkpoint in ``path``
    (one file or shards with an index)."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        weight_map = {name: "model.safetensors" for name in wanted}
    files: Dict[str, List[str]] = {}
    for name in wanted:
        if name not in weight_map:
            raise ValueError(f"path: the checkpoint in {path} has no {name} (its config says it is an HKT model)")
        files.setdefault(weight_map[name], []).append(name)
    out = {}
    for file, names in files.items():
        with safe_open(os.path.join(path, file), framework="pt") as f:
            have = set(f.keys())
            for name in names:
                if name not in have:
                    raise ValueError(f"path: the checkpoint in {path} has no {name} (its config says it is an "
                                     "HKT model)")
                out[name] = f.get_tensor(name)
    return out


def from_pretrained(model_class, path: str, **kwargs) -> nn.Module:
    """``model_class.from_pretrained(path, **kwargs)`` of a model converted and
    saved with ``save_pretrained``: its base weights loaded by transformers,
    converted with the options in its config (``config.hkt``), then its HKT
    parameters loaded from the checkpoint.  ``path`` is a local directory.
    ``model_class`` may be an Auto class (``AutoModel``,
    ``AutoModelForCausalLM``): the class it picks for the saved config loads it."""
    if getattr(model_class, "_model_mapping", None) is not None:  # an Auto class
        from transformers import AutoConfig
        from transformers.models.auto.auto_factory import _get_model_class
        model_class = _get_model_class(AutoConfig.from_pretrained(path), model_class._model_mapping)
    config = model_class.config_class.from_pretrained(path)
    options = getattr(config, CONFIG_KEY, None)
    if not isinstance(options, dict):
        raise ValueError(f"path: the config in {path} has no '{CONFIG_KEY}' entry: not saved from a model converted "
                         "by hkt.integrations.transformers.convert")
    options = dict(options)
    # transformers' own list of checkpoint keys the class does not define but expects:
    # the HKT parameters, which convert adds after it loads the rest (its load
    # report would otherwise call them unexpected)
    own = "_keys_to_ignore_on_load_unexpected" in model_class.__dict__
    before = model_class.__dict__.get("_keys_to_ignore_on_load_unexpected")
    model_class._keys_to_ignore_on_load_unexpected = list(before or []) + [r"\.hkt\."]
    try:
        model = model_class.from_pretrained(path, **kwargs)
    finally:
        if own:
            model_class._keys_to_ignore_on_load_unexpected = before
        else:
            del model_class._keys_to_ignore_on_load_unexpected
    convert(model, options.pop("levels"), options.pop("downsample_kernel"), **options)
    names = [n for n in model.state_dict() if ".hkt." in n]
    loaded = _checkpoint_tensors(path, names)
    missing, _ = model.load_state_dict(loaded, strict=False)
    left = [n for n in missing if ".hkt." in n]
    if left:
        raise ValueError(f"path: the checkpoint in {path} lacks HKT parameters {left[:3]}")
    return model
