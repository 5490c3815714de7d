"""The checkpoint cache: a converted model kept on disk (not a KV cache), self-checking: atomic writes, a
manifest, detection and repair.

A cache folder holds the converted files plus ``speculum-manifest.json``: the format version, each file's
size and sha256, the identity of the source file (size and a sha256 of its first and last MiB), and
where and when the checksums were last confirmed (machine id and each file's stat stamp). The folder is
filled under a temporary sibling name, the manifest is written last, and the folder is renamed into place,
so a cache either is complete or does not exist under its name.

Checking a cache costs a few ``stat`` calls and a 2 MiB read of the source. The full checksum (~0.5 s per
500 MB) runs when asked for (``verify=True``), when this machine (host and boot) has not confirmed it yet,
or when a file's stat stamp (inode, size, mtime, ctime) moved since the last confirmation: any write
through the file system changes ctime, so in-place damage is caught without reading the weights.

:func:`load_cached` is the entry point. Its guarantee: it returns what ``load`` makes of a cache that
passes the check, or what ``load_uncached`` makes of the source when the cache cannot be written; a cache
that fails the check or does not load is rebuilt at most once per call, with a one-line warning (logger
``speculum``); every other failure is a :class:`ModelCacheError` with a one-line message.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

__all__ = ["MANIFEST_NAME", "FORMAT_VERSION", "ModelCacheError", "load_cached", "write_cache", "inspect_cache",
           "source_identity", "machine_id"]

MANIFEST_NAME = "speculum-manifest.json"
FORMAT_VERSION = 1
_CHUNK = 1 << 20          # read size when hashing
_EDGE = 1 << 20           # bytes hashed at each end of the source file
_STALE_STAGING_S = 3600   # a staging folder this old belongs to a killed conversion (one takes ~30 s)

log = logging.getLogger("speculum")
Loaded = TypeVar("Loaded")


class ModelCacheError(ValueError):
    """The model could be loaded neither from its cache nor from its source (the message is one line).

    A ValueError so that callers which report bad input as one line (the CLI among them) report this too.
    """


# ------------------------------------------------------------------------------------ identities
def source_identity(source: Path) -> dict[str, Any]:
    """Size, mtime and a sha256 of the first and last MiB of ``source``: cheap, and enough to tell two
    releases of a model file apart. Only size and hash are compared (the path and mtime differ between
    virtual environments holding the same wheel)."""
    stat = os.stat(source)
    digest = hashlib.sha256()
    with open(source, "rb") as handle:
        digest.update(handle.read(_EDGE))
        if stat.st_size > _EDGE:
            handle.seek(max(_EDGE, stat.st_size - _EDGE))
            digest.update(handle.read(_EDGE))
    return {"path": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "edge_sha256": digest.hexdigest()}


def machine_id() -> str:
    """Host name plus the kernel's boot id where readable: a new boot re-confirms checksums once, which
    catches damage from a crash between writing the data and the disk holding it."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(stat: os.stat_result) -> list[int]:
    """What any write through the file system changes: size, inode, mtime, ctime (the last is ``_STAMP_CTIME``)."""
    return [stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns]


_STAMP_CTIME = 3


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "no details"
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}"


# ------------------------------------------------------------------------------------ manifest
def _data_files(folder: Path) -> list[str]:
    """Every entry of ``folder`` except the manifest and hidden names (temporary files)."""
    return sorted(name for name in os.listdir(folder) if name != MANIFEST_NAME and not name.startswith("."))


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest through a temporary file and a rename, so a reader sees the old or the new one."""
    handle, temporary = tempfile.mkstemp(prefix=f".{MANIFEST_NAME}.", dir=folder)
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(manifest, stream, indent=1, sort_keys=True)
        os.replace(temporary, folder / MANIFEST_NAME)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _confirmation(folder: Path, names: list[str]) -> dict[str, Any]:
    return {"machine": machine_id(), "stamps": {name: _stamp(os.stat(folder / name)) for name in names}}


def inspect_cache(target: Path, source: Path | None, *, verify: bool = False) -> str | None:
    """None when ``target`` is a sound cache built from ``source``, else a one-line reason why not.

    ``source=None`` skips the source comparison. Sizes are always checked; checksums when ``verify``,
    when this machine has not confirmed them, or when a file's stat stamp moved. A successful full check
    is recorded in the manifest (best effort: a read-only cache is checked again next time).
    """
    try:
        manifest_path = target / MANIFEST_NAME
        raw = manifest_path.read_bytes()
        manifest_ctime = os.stat(manifest_path).st_ctime_ns
        names = _data_files(target)
    except FileNotFoundError:
        return "its manifest is missing"
    except OSError as exc:
        return f"it cannot be read ({_one_line(exc)})"
    try:
        manifest = json.loads(raw)
        version = manifest["format"]
        expected = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}
        recorded_source = dict(manifest["source"])
        confirmed = dict(manifest.get("confirmed") or {})
        stamps = dict(confirmed.get("stamps") or {})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its manifest is unreadable ({_one_line(exc)})"
    if version != FORMAT_VERSION:
        return f"it has cache format {version!r}, this speculum writes {FORMAT_VERSION}"
    if source is not None:
        current = source_identity(source)
        if [recorded_source.get(k) for k in ("size", "edge_sha256")] != [current["size"], current["edge_sha256"]]:
            return f"it was converted from another version of {source.name}"
    missing = sorted(set(expected) - set(names))
    if missing:
        return f"{missing[0]} is missing"
    extra = sorted(set(names) - set(expected))
    if extra:
        return f"it holds an unexpected entry {extra[0]!r}"
    full = verify or confirmed.get("machine") != machine_id()
    for name, (size, _) in expected.items():
        try:
            stat = os.stat(target / name)
        except OSError as exc:
            return f"{name} cannot be read ({_one_line(exc)})"
        if not os.path.isfile(target / name):
            return f"{name} is not a regular file"
        if stat.st_size != size:
            return f"{name} has {stat.st_size} bytes, {size} expected"
        # A stamp taken in the same clock tick as the manifest could miss a write in that tick (git's
        # "racy clean" case): only a stamp strictly older than the manifest spares the checksum.
        current = _stamp(stat)
        full = full or stamps.get(name) != current or current[_STAMP_CTIME] >= manifest_ctime
    if not full:
        return None
    for name, (_, checksum) in expected.items():
        try:
            if _file_sha256(target / name) != checksum:
                return f"{name} does not match its checksum"
        except OSError as exc:
            return f"{name} cannot be read ({_one_line(exc)})"
    try:
        _write_manifest(target, {**manifest, "confirmed": _confirmation(target, sorted(expected))})
    except OSError:
        pass  # a read-only cache stays usable; it is checked in full again next time
    return None


# ------------------------------------------------------------------------------------ writing
def write_cache(target: Path, source: Path, write: Callable[[Path], None]) -> Path:
    """Build the cache ``target`` from ``source`` atomically: ``write(folder)`` fills a temporary sibling,
    the manifest is added, and the folder is renamed into place.

    A sound cache already at ``target`` (another process finished first) is kept; a damaged one is
    replaced. Raises OSError when the cache cannot be written; nothing is left behind on any failure.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(staging)
        names = _data_files(staging)
        files = {name: {"size": os.stat(staging / name).st_size, "sha256": _file_sha256(staging / name)}
                 for name in names}
        _write_manifest(staging, {"format": FORMAT_VERSION, "source": source_identity(source), "files": files,
                                  "confirmed": _confirmation(staging, names)})
        try:
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            if inspect_cache(target, source) is None:
                return target  # another process built a sound copy first: keep it
            _discard(target)
            os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _discard(path: Path) -> None:
    """Remove a file or folder: renamed aside first, so its name is free even if deletion is partial."""
    aside = path.with_name(f".{path.name}.discarded-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def _sweep_stale_staging(target: Path) -> None:
    """Delete staging and discarded folders left by conversions that were killed (SIGKILL, power loss)."""
    cutoff = time.time() - _STALE_STAGING_S
    for leftover in target.parent.glob(f".{target.name}.*"):
        try:
            if leftover.is_dir() and leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue


# ------------------------------------------------------------------------------------ loading
def load_cached(
    target: Path,
    source: Path,
    *,
    write: Callable[[Path], None],
    load: Callable[[Path], Loaded],
    load_uncached: Callable[[], Loaded],
    verify: bool = False,
) -> Loaded:
    """Load the model converted from ``source`` through the cache folder ``target``, repairing it.

    Args:
        write: fills a folder with the converted files (called at most once per call).
        load: makes the model from a cache folder; any Exception it raises marks the cache as damaged.
        load_uncached: makes the model from ``source`` directly, when the cache cannot be written.
        verify: check every file's checksum even where this machine has confirmed them.

    Raises ModelCacheError (one line) when neither a rebuilt cache nor the source loads.
    """
    present = os.path.lexists(target)
    if present:
        try:
            reason = inspect_cache(target, source, verify=verify)
        except OSError as exc:  # the cache's own read errors are reasons; this one is the source's
            raise ModelCacheError(f"cannot read {source}: {_one_line(exc)}") from exc
        if reason is None:
            try:
                return load(target)
            except Exception as exc:  # damage the checks cannot see (bits flipped in place, stamps intact)
                reason = f"it does not load ({_one_line(exc)})"
        log.warning("speculum: the model cache at %s is damaged (%s): rebuilding it", target, reason)
    try:
        if present:
            _discard(target)
        write_cache(target, source, write)
    except Exception as exc:
        log.warning("speculum: cannot write the model cache at %s (%s): loading %s directly, without caching",
                    target, _one_line(exc), source)
        try:
            return load_uncached()
        except Exception as uncached_exc:
            raise ModelCacheError(f"cannot load the model from {source}: {_one_line(uncached_exc)}") from uncached_exc
    try:
        return load(target)
    except Exception as exc:
        raise ModelCacheError(f"the freshly built model cache at {target} does not load: {_one_line(exc)}") from exc
