"""Helpers for the environment tests: installed distributions written the way installers write them."""

from __future__ import annotations

import json
from pathlib import Path


def write_dist(
    site: Path,
    name: str,
    version: str,
    files: dict[str, bytes | str],
    *,
    record: bool = True,
    top_level: list[str] | None = None,
    tag: str = "py3-none-any",
    direct_url: dict | None = None,
    extra_record: tuple[str, ...] = (),
) -> Path:
    """Writes a distribution into ``site`` as pip lays it out: its files plus a ``.dist-info``.

    Args:
        site: The site-packages folder.
        name: Distribution name.
        version: Its version.
        files: Path relative to ``site`` -> content.
        record: Write a RECORD listing every file (some system packages have none).
        top_level: Names for ``top_level.txt``.
        tag: The wheel tag (``py3-none-any`` is pure Python).
        direct_url: Content of ``direct_url.json`` (PEP 610), e.g. for editable installs.
        extra_record: More RECORD rows (files outside site-packages, byte-code).

    Returns:
        The ``.dist-info`` folder.
    """
    site.mkdir(parents=True, exist_ok=True)
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    meta = {
        "METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: test\n\nA long description.\n",
        "WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    if top_level is not None:
        meta["top_level.txt"] = "\n".join(top_level) + "\n"
    if direct_url is not None:
        meta["direct_url.json"] = json.dumps(direct_url)
    for rel, content in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    for rel, content in meta.items():
        (dist_info / rel).write_text(content)
    if record:
        rows = list(files) + [f"{dist_info.name}/{rel}" for rel in meta] + list(extra_record)
        rows.append(f"{dist_info.name}/RECORD")
        (dist_info / "RECORD").write_text("".join(f"{row},,\n" for row in rows))
    return dist_info


def arcnames(component) -> list[str]:
    return sorted(f.arcname for f in component.files)


def by_name(snapshot) -> dict:
    return {c.name: c for c in snapshot.components}
