"""File-system helpers for tests."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path


def tree_snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root (the root included): type, mode, size, mtime, content hash."""
    out = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
        out[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                            st.st_size, st.st_mtime_ns, digest)
    return out
