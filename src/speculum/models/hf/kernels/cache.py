"""Where compiled kernels and their records live: speculum's cache folder where no other user can write
to it, else a private folder for this process.

Why: a library found in the cache is loaded into the process and run, and a record beside it decides
whether a check runs (the tiles' child-process test) or a build is tried. Whoever can write into the
folder, or replace a file in it, could make this process run their code or skip that check. So, as pip and
ccache do, a folder or file is trusted only where it belongs to this user (or to root) and neither its
group nor other users may write to it. An untrusted cache folder (``kernels`` or the cache folder holding
it) is not used: the kernels are built into a private temporary folder for this process (removed at exit)
and :func:`kernel_folder` says why; an untrusted file in a trusted folder is ignored and replaced.

Records are small JSON files written atomically (a temporary file, then a rename) with mode 0644, and a
library lands with mode 0755, whatever the umask.

Example:
    >>> kernel_folder().path.name in ("kernels",) or kernel_folder().private   # doctest: +SKIP
    True
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...paths import cache_dir

__all__ = ["KernelFolder", "kernel_folder", "untrusted", "read_record", "write_record", "private_folder"]


@dataclass(frozen=True)
class KernelFolder:
    """The folder kernels are read from and built into; ``distrust``: why speculum's cache folder is not
    used (None where it is); ``private``: a folder of this process only."""

    path: Path
    distrust: str | None = None
    private: bool = False


def untrusted(path: Path) -> str | None:
    """None where ``path`` is absent, or belongs to this user (or root) and only its owner may write to it;
    else why it cannot be trusted (one line)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    if info.st_uid not in (os.getuid(), 0):
        return f"{path} belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} may be written by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def kernel_folder() -> KernelFolder:
    """The cache's ``kernels`` folder, created (mode 0755) where absent, when it and the cache folder
    holding it are trusted (see the module); else this process's private folder, with the reason."""
    cache = cache_dir()
    folder = cache / "kernels"
    for path in (cache, folder):
        try:
            path.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            if not path.is_dir():       # a read-only cache may still hold built kernels
                return KernelFolder(private_folder(), f"{path} cannot be created ({exc.strerror or exc})", True)
        reason = untrusted(path)
        if reason is not None:
            return KernelFolder(private_folder(), reason, True)
    return KernelFolder(folder)


@functools.lru_cache(maxsize=1)
def private_folder() -> Path:
    """A folder only this process uses (mode 0700), removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix="speculum-kernels-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def read_record(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path`` where it is a trusted file holding one, else None."""
    if not path.is_file() or untrusted(path) is not None:
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_record(path: Path, value: dict[str, Any]) -> bool:
    """Write ``value`` as JSON into ``path`` atomically (mode 0644); False where the folder is not writable
    (the record is then simply not kept)."""
    try:
        handle, scratch = tempfile.mkstemp(dir=path.parent, prefix=".record-")
    except OSError:
        return False
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(value, out)
        os.chmod(scratch, 0o644)
        os.replace(scratch, path)
    except OSError:
        Path(scratch).unlink(missing_ok=True)
        return False
    return True
