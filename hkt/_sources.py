"""The digest of the C sources hkt._C is built from: setup.py builds it into the
extension (hkt._C.source_hash), and hkt/__init__.py compares it with the digest
of the csrc/ beside the package.  One function for both, so the two cannot
drift apart; it imports nothing of hkt or torch (setup.py loads this file by
its path, before anything is built)."""
import hashlib
import os
from typing import Optional


def source_digest(folder: str) -> Optional[str]:
    """16 hex digits of sha256 over the names and contents of folder's C sources
    (*.c, *.h, *.cu; files only: an editor's lock file, .#x.c, a dangling link,
    is no source), or None where folder cannot be read."""
    h = hashlib.sha256()
    try:
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if name.endswith((".c", ".h", ".cu")) and not name.startswith(".") and os.path.isfile(path):
                with open(path, "rb") as f:
                    h.update(name.encode() + b"\0" + f.read() + b"\0")
    except OSError:
        return None
    return h.hexdigest()[:16]
