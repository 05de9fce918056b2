"""hkt in other libraries' models.  Nothing here is imported by ``import hkt``:
each integration needs its library (an optional extra) and is imported on its own.

    import hkt.integrations.transformers    Hugging Face transformers (pip install "hkt[transformers]")
"""
