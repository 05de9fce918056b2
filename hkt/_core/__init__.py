"""What every layer of hkt stands on, with no torch.library op registered:
the calls into the extension (kernels.py, the only module that imports
hkt._C besides hkt/__init__'s loader), the argument rules only Python can
check (checks.py), how a call meets torch (guards.py), the maths computed in
plain torch (maths.py), and the C sources' digest (sources.py, which setup.py
also loads by its path)."""
