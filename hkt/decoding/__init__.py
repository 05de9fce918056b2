"""Decoding state: LevelStore and LevelCache (level_cache.py),
and decoding with windowed levels (windowed.py).  The KV-cache functional they
call is hkt.hkt_attention_with_kvcache (hkt/kvcache.py); the public name here
is hkt.LevelCache."""
