"""Small files in the tool's folder on a host: its layout for a host, JSON read and write."""

from __future__ import annotations

import json
import os
import shlex
import tempfile

from .errors import TransferError
from .inventory import Host
from .plan import Layout
from .transport import Transport


def layout_for(host: Host, t: Transport) -> Layout:
    return Layout(t.remote_dir, host.cuda_arch)


def read_remote_json(t: Transport, path: str) -> dict | None:
    """A JSON file on the host, or None when it does not exist."""
    r = t.run(f"cat {shlex.quote(path)} 2>/dev/null || exit 44", timeout=t.host.timeouts.connect)
    if r.exit_code == 44:
        return None
    if not r.ok:
        raise TransferError(f"reading {path}: {r.tail()}", host=t.host.name)
    try:
        return json.loads(r.stdout)
    except ValueError as e:
        raise TransferError(f"{path} is not valid JSON: {e}", host=t.host.name) from None


def write_remote_json(t: Transport, path: str, obj: dict) -> None:
    """Write obj as JSON on the host (through a local temp file and put, which is atomic)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        local = f.name
    try:
        t.put(local, path)
    finally:
        os.unlink(local)
