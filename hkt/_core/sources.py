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
    (*.c, *.h, *.cu, in folder and its subfolders such as csrc/binding/; files
    only: an editor's lock file, .#x.c, a dangling link, is no source), or None
    where folder cannot be read."""
    h = hashlib.sha256()
    try:
        os.listdir(folder)  # an unreadable folder is None, not the digest of nothing
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(root, name)
                if name.endswith((".c", ".h", ".cu")) and not name.startswith(".") and os.path.isfile(path):
                    rel = os.path.relpath(path, folder).replace(os.sep, "/")
                    with open(path, "rb") as f:
                        h.update(rel.encode() + b"\0" + f.read() + b"\0")
    except OSError:
        return None
    return h.hexdigest()[:16]
