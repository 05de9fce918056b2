"""The nn.Modules: Levels (levels.py, the levels above level 0), MultiheadHKT
and swap_attention (modules.py: nn.MultiheadAttention's surface around
Levels), MHA's inputs made into hkt_attention's (_mha_inputs.py) and which of
a module's weights torch.nn.utils computes (_mha_weights.py).  The public
names are hkt.Levels, hkt.MultiheadHKT and hkt.swap_attention."""
