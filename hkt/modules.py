"""hkt.modules, the module 0.2.0 defined MultiheadHKT in: kept so that a module
saved whole with torch.save (a pickle naming hkt.modules.MultiheadHKT) still
loads.  The class lives in hkt/nn/modules.py; use hkt.MultiheadHKT."""
from .nn.modules import MultiheadHKT, swap_attention  # noqa: F401

__all__ = ["MultiheadHKT", "swap_attention"]
