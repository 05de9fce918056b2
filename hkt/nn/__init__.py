"""The nn.Modules: Levels (levels.py, the levels above level 0, one base for
the layouts of their coarse projections), MHALevels (_mha_levels.py, the
layout of the streams' projections), MultiheadHKT and swap_attention
(modules.py: nn.MultiheadAttention's surface around MHALevels), MHA's inputs
made into hkt_attention's (_mha_inputs.py) and which of a module's weights
torch.nn.utils computes (_mha_weights.py).  The public names are hkt.Levels,
hkt.MultiheadHKT and hkt.swap_attention."""
