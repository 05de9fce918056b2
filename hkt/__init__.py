"""hkt: Hierarchical Kernel Transformer attention for PyTorch.

    hkt.hkt_attention(q, k, v, w, *, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None, backend=None,
                      windows=None, softcap=None, sliding_window=None)
                                             (k, v may have fewer heads than q: grouped-query attention;
                                             windows: a window per level; softcap: scores capped to c tanh(s / c);
                                             sliding_window: key j seen from query i only when i - j < W)
    hkt.hkt_attention_varlen(q, k, v, w, cu_seqlens_q, cu_seqlens_k, ...)   packed variable-length batches
    hkt.hkt_attention_with_kvcache(q, k_cache, v_cache, w, cache_seqlens, k=None, v=None, *, scale=None,
                                   softcap=None, sliding_window=None)   decoding with a KV cache
    hkt.MultiheadHKT(embed_dim, num_heads, ..., levels=3, downsample_kernel=2, num_kv_heads=None,
                     pack_padding=False)   drop-in nn.MultiheadAttention; .init_cache / .decode for generation
    hkt.swap_attention(model, levels=3)      replace every nn.MultiheadAttention in a model
    hkt.Levels, hkt.LevelCache               the levels above level 0 and their decoding state
    hkt.reference                            plain-PyTorch definition, for checking
    import hkt.analysis                      the paper's claims as functions (cost, PSD, splits, error curves);
                                             not loaded by ``import hkt``

The experiments that reproduce the paper, their data loaders and the benchmarks'
timing helpers are not part of the package: they live in research/ of the source
repository.

The exact contract (maths, masks, dropout, gradients, non-finite values, API):
docs/contract.md in the source repository.
"""
def _load_extension():
    """hkt._C, with the error a user can act on where it is not built here (the
    bare one reads as a circular import), and a warning where it was built from
    other C sources than the csrc/ beside the package (a source checkout pulled
    or edited, not rebuilt: the Python layer and the kernels may not match)."""
    import importlib.util
    import os
    try:
        from . import _C
    except ImportError as e:
        if importlib.util.find_spec(__name__ + "._C") is not None:
            raise  # there, but it does not load: its own error says why
        raise ImportError("hkt's C extension (hkt/_C*.so) is not built: in the source tree run `pip install -e .` "
                          "(or `make install`), or install hkt with pip") from e
    csrc = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "csrc")
    built = getattr(_C, "source_hash", None)
    if built is not None and os.path.isfile(os.path.join(csrc, "hkt.h")):
        from ._core.sources import source_digest
        here = source_digest(csrc)
        # None: unreadable, and a check that only warns never stops the import
        if here is not None and here != built:
            import warnings
            warnings.warn(f"hkt._C was built from other C sources than those in {os.path.normpath(csrc)}: rebuild "
                          "it (`pip install -e .` or `make install` there), or the Python layer and the kernels "
                          "may not match", RuntimeWarning, stacklevel=3)


# torch first: hkt._C needs an OpenMP runtime (libgomp.so.1), and the one torch
# ships is then already loaded and serves both.  The other way round, the
# system's libgomp would load first, and a torch whose copy has another file
# name (libgomp-<hash>.so.1, as 2.4's) would load its own beside it: two thread
# pools oversubscribing the cores.
import torch  # noqa: E402,F401

_load_extension()

from . import reference  # noqa: E402
from .functional import hkt_attention  # noqa: E402
from .kvcache import hkt_attention_with_kvcache  # noqa: E402
from .decoding.level_cache import LevelCache  # noqa: E402
from .nn.levels import Levels  # noqa: E402
from .nn.modules import MultiheadHKT, swap_attention  # noqa: E402
from .varlen import hkt_attention_varlen, pack_levels, varlen_level_offsets  # noqa: E402

__all__ = ["hkt_attention", "hkt_attention_with_kvcache", "hkt_attention_varlen", "varlen_level_offsets", "pack_levels",
           "MultiheadHKT", "swap_attention", "Levels", "LevelCache", "reference"]
__version__ = "0.2.0"
