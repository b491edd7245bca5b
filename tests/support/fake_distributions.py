"""Distributions installed the way pip installs them, without pip: a ``*.dist-info`` with ``patchbay`` entry points."""

from __future__ import annotations

from pathlib import Path


def write_dist_info(root: Path, name: str, version: str, entry_points: dict[str, str]) -> Path:
    """Install distribution ``name`` in ``root`` as pip would: a ``*.dist-info`` with ``patchbay`` entry points.

    ``entry_points`` maps entry-point names to their values (hooks modules);
    returns the ``*.dist-info`` directory.
    """
    dist_info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = [f"{ep_name} = {value}" for ep_name, value in entry_points.items()]
    (dist_info / "entry_points.txt").write_text("[patchbay]\n" + "\n".join(lines) + "\n")
    return dist_info
