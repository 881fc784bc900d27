"""A Kubernetes Secret volume as the kubelet writes it, for rotation tests.

``<root>/user.crt`` is a symlink to ``..data/user.crt``, ``..data`` a symlink to a
versioned directory; new content goes into a fresh directory and ``..data`` is swapped to
it in one rename, so every visible path changes content at once and none is ever
rewritten in place.
"""

from __future__ import annotations

import os
from pathlib import Path


class SecretVolume:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.versions = 0
        root.mkdir(parents=True, exist_ok=True)

    def publish(self, files: dict[str, bytes]) -> None:
        """Write a new version and swap ``..data`` to it atomically."""
        self.versions += 1
        version = self.root / f"..v{self.versions}"
        version.mkdir()
        for name, content in files.items():
            (version / name).write_bytes(content)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(version.name)
        os.replace(tmp, self.root / "..data")
        for name in files:
            link = self.root / name
            if not link.is_symlink():
                link.symlink_to(Path("..data") / name)

    def path(self, name: str) -> str:
        return str(self.root / name)
