"""C kernels compiled on this machine on first use, for its CPU, and cached.

Why: PyTorch's CPU kernels cannot multiply float32 rows by GGUF weight groups
(:mod:`~speculum.models.hf.kernels.gguf_groups`), nor keep each row's sum in one order on AMX tiles
(:mod:`~speculum.models.hf.kernels.amx_tiles`). These small kernels can; they are built with the machine's C compiler
(``$CC``, parsed as a shell would, else ``cc`` or ``gcc``; ``-march=native``: the CPU's own instructions)
and run on PyTorch's OpenMP threads.

Identity: a library is named by the hash of its source, its flags, the OpenMP runtime it links and the
CPU's model and flags (:func:`library_stem`). None of them needs the compiler, so a cache filled
beforehand serves a machine without one, and a change of any of them builds the library again. The
compiler's command and version are recorded beside the library (``<stem>.json``); a compiler upgrade
alone does not rebuild it: the source fixes every sum's order (no fast-math, no contraction), so any
compiler computes the same numbers. The build lands by an atomic rename. Where the cache is not safe to
share or not writable, the library is built into a folder of this process
(:mod:`~speculum.models.hf.kernels.cache`).

Failures: a build that fails is recorded (``<stem>.failed``) with its reason and the compiler it ran (its
file's path, size and time stamp), and later processes with that compiler report the reason without
trying again. Another ``CC``, a changed compiler, or deleting the record (or the cache) tries again.

OpenMP: PyTorch's wheel bundles its own OpenMP runtime; ``-fopenmp`` alone would link the system's, and
the process would hold two thread pools. So the library links the runtime PyTorch has loaded, by its file
(where the compiler's OpenMP ABI is another one, clang's, it links the compiler's own).

``SPECULUM_KERNELS=off`` turns every compiled kernel off (:func:`kernels_disabled`): each product takes
its fallback on PyTorch's kernels.

Loading: each kernel module holds one :class:`KernelLibrary`, which builds and loads its library once per
process on first use, after the module's own checks (a CPU flag before building; argument types and
compiled-in probes after loading), and says why it is unavailable where it is.

Example:
    >>> path = build("grouped", Path(__file__).with_name("gguf_groups.c"))   # doctest: +SKIP
    >>> KernelLibrary("rowops", Path(__file__).with_name("row_ops.c"), "row operations").unavailable()  # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

import torch  # noqa: F401  (loads PyTorch's OpenMP runtime, which the kernels link)

from ...cpu import cpu_identity
from .cache import kernel_folder, private_folder, read_record, untrusted, write_record

__all__ = ["build", "load_library", "KernelLibrary", "kernels_disabled", "compiler_command", "library_release",
           "library_stem", "openmp_runtime", "FLAGS"]

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC"]      # compiling, not linking
_OFF = {"off", "0", "no", "false"}
_OPENMP = re.compile(r"lib(gomp|iomp5|omp)(-\w+)?\.so(\.\d+)*")
_REASON_CHARS = 2000        # a compiler's messages, kept whole up to this length
_log = logging.getLogger("speculum")


def kernels_disabled() -> str | None:
    """Why the compiled kernels are off (``SPECULUM_KERNELS=off``, ``0``, ``no`` or ``false``), else None.
    Every caller then takes its fallback on PyTorch's kernels."""
    value = os.environ.get("SPECULUM_KERNELS", "")
    if value.strip().lower() in _OFF:
        return f"compiled kernels are off (SPECULUM_KERNELS={value.strip()})"
    return None


@functools.lru_cache(maxsize=1)
def openmp_runtime() -> Path | None:
    """The OpenMP runtime library PyTorch has loaded into this process (None where none is mapped)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and _OPENMP.fullmatch(Path(parts[5]).name):
            return Path(parts[5])
    return None


def compiler_command() -> list[str] | None:
    """The C compiler's command: ``$CC`` split as a shell splits it (``ccache gcc``), else ``cc`` or
    ``gcc`` on the PATH; None where there is none. Raises RuntimeError where ``$CC`` cannot be parsed."""
    try:
        words = shlex.split(os.environ.get("CC", ""))
    except ValueError as exc:
        raise RuntimeError(f"CC={os.environ['CC']!r} cannot be parsed: {exc}") from None
    if words:
        return words
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def library_stem(name: str, source: Path) -> str:
    """``<name>-<hash>``: the hash of the source, the flags, the OpenMP runtime linked and the CPU (see the
    module), found without running the compiler."""
    runtime = openmp_runtime()
    parts = [source.read_bytes(), " ".join(FLAGS).encode(), str(runtime or "-fopenmp").encode(),
             cpu_identity().encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()
    return f"{name}-{digest[:20]}"


def library_release(source: Path) -> str:
    """The hash of the source and the flags: what two machines compare (their CPUs aside) to know that
    they compile the same kernel."""
    return hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(FLAGS).encode()])).hexdigest()[:12]


_LOADING = threading.Lock()      # one build at a time in a process (they share the cache folder)


def load_library(name: str, source: Path, what: str) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library of ``source``, built as ``name`` (:func:`build`) and loaded, None), or (None, why not in
    one line, also logged with ``what`` the products fall back to). Callers keep the result once per
    process."""
    with _LOADING:
        try:
            return ctypes.CDLL(str(build(name, source))), None
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            reason = " ".join(str(exc).split())
            _log.info("%s unavailable (%s)", what, reason)
            return None, reason


class KernelLibrary:
    """One compiled kernel library of this package: built and loaded once per process, on first use.

    ``name``, ``source`` and ``what`` are :func:`load_library`'s. ``requires()`` runs before building: a
    reason (one line) means the library is unavailable and nothing is built (a CPU without the instructions
    the source needs). ``configure(library)`` runs after loading: it sets the functions' argument types and
    runs compiled-in checks; a reason means the library is unavailable."""

    def __init__(self, name: str, source: Path, what: str, requires: Callable[[], str | None] | None = None,
                 configure: Callable[[ctypes.CDLL], str | None] | None = None) -> None:
        self.name, self.source, self.what = name, source, what
        self._requires, self._configure = requires, configure
        self._result: tuple[ctypes.CDLL | None, str | None] | None = None
        self._lock = threading.Lock()

    def loaded(self) -> tuple[ctypes.CDLL | None, str | None]:
        """(the library, None), or (None, why it is unavailable): found once per process (until
        :meth:`forget`), whatever ``SPECULUM_KERNELS`` says."""
        result = self._result
        if result is None:
            with self._lock:
                if self._result is None:
                    self._result = self._load()
                result = self._result
        return result

    def library(self) -> ctypes.CDLL | None:
        """The loaded library; None where it is unavailable or ``SPECULUM_KERNELS=off`` (read at each call)."""
        return None if kernels_disabled() else self.loaded()[0]

    def unavailable(self) -> str | None:
        """None when the library is built and loaded here, else why not (one line); ``SPECULUM_KERNELS=off``
        is read at each call."""
        return kernels_disabled() or self.loaded()[1]

    def require(self, what: str, off_switch: bool = True) -> ctypes.CDLL:
        """The loaded library, or RuntimeError ``"<what> are unavailable: <why>"``. ``off_switch``: the reason
        includes ``SPECULUM_KERNELS=off`` (False for what a model chose at load and must keep for life)."""
        library, reason = self.loaded()
        reason = (kernels_disabled() if off_switch else None) or reason
        if reason is not None:
            raise RuntimeError(f"{what} are unavailable: {reason}")
        return library

    def forget(self) -> None:
        """Drop the library found (or why not): the next use looks for it and builds it again."""
        with self._lock:
            self._result = None

    def _load(self) -> tuple[ctypes.CDLL | None, str | None]:
        reason = self._requires() if self._requires is not None else None
        if reason is not None:
            return None, reason
        library, reason = load_library(self.name, self.source, self.what)
        if library is None:
            return None, reason
        reason = self._configure(library) if self._configure is not None else None
        return (None, reason) if reason is not None else (library, None)


def build(name: str, source: Path) -> Path:
    """The compiled library of ``source`` for this machine: found in the cache, else built into it.

    Raises RuntimeError naming the cause (in full: the compiler's exit status and messages) where there is
    no compiler or the source does not compile, here or as recorded for this compiler (see the module)."""
    where = kernel_folder()
    if where.distrust is not None:
        _warn_private(where.distrust, str(where.path))
    stem = library_stem(name, source)
    target = where.path / f"{stem}.so"
    if target.is_file() and untrusted(target) is None:
        return target
    command = compiler_command()
    if command is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH, nor CC")
    failed = where.path / f"{stem}.failed"
    stamp = _compiler_stamp(command)
    record = read_record(failed)
    if record is not None and record.get("compiler") == stamp:
        raise RuntimeError(f"{record.get('reason')} (recorded in {failed}: delete it, or set CC to another "
                           "compiler, to try again)")
    try:
        scratch = Path(tempfile.mkdtemp(dir=where.path))
    except OSError:                     # a cache that cannot be written: build for this process only
        scratch, target = Path(tempfile.mkdtemp(dir=private_folder())), None
    built = scratch / f"{stem}.so"
    try:
        link = _compile(name, command, source, built)
    except RuntimeError as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        write_record(failed, {"compiler": stamp, "reason": str(exc)})
        raise
    os.chmod(built, 0o755)              # whatever the umask: a library only its owner may replace
    if target is None:
        return built                    # a folder of this process holds it
    os.replace(built, target)
    shutil.rmtree(scratch, ignore_errors=True)
    failed.unlink(missing_ok=True)
    write_record(target.with_suffix(".json"),
                 {"compiler": shlex.join(command), "version": _compiler_version(command), "openmp": link})
    return target


@functools.lru_cache(maxsize=None)
def _warn_private(reason: str, folder: str) -> None:
    """One warning per process and reason: the shared kernel cache is not used."""
    _log.warning("the kernel cache is not safe to share (%s): kernels are built for this process in %s",
                 reason, folder)


def _compiler_stamp(command: list[str]) -> list[str]:
    """The compiler as a failure record names it: each word of its command, and for each word that is a
    program its file's real path, size and time stamp (an upgrade in place changes them)."""
    stamp = []
    for word in command:
        found = shutil.which(word)
        try:
            info = os.stat(found) if found else None
        except OSError:
            info = None
        stamp.append(f"{os.path.realpath(found)}:{info.st_size}:{info.st_mtime_ns}" if info else word)
    return stamp


def _compiler_version(command: list[str]) -> str:
    try:
        result = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (result.stdout.strip().splitlines() or ["unknown"])[0]


def _compile(name: str, command: list[str], source: Path, out: Path) -> str:
    """Compile ``source`` into the library ``out``; returns the OpenMP runtime it links (a file, or
    ``-fopenmp``: the compiler's own)."""
    objects = out.with_suffix(".o")
    _run(name, command, [*FLAGS, "-c", str(source), "-o", str(objects)])
    runtime = openmp_runtime()
    if runtime is not None:
        try:
            # -z defs: a symbol the runtime lacks (another OpenMP ABI) fails here, not when loading.
            _run(name, command, ["-shared", str(objects), str(runtime), f"-Wl,-rpath,{runtime.parent}",
                                 "-Wl,-z,defs", "-o", str(out)])
            return str(runtime)
        except RuntimeError:
            pass
    _run(name, command, ["-shared", "-fopenmp", str(objects), "-o", str(out)])
    return "-fopenmp"


def _run(name: str, command: list[str], arguments: list[str]) -> None:
    """Run the compiler; RuntimeError with its whole reason where it fails."""
    prefix = f"the {name} kernel does not compile here:"
    shown = shlex.join(command)
    try:
        result = subprocess.run([*command, *arguments], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{prefix} the compiler ({shown}) ran past 300 s") from None
    except OSError as exc:
        raise RuntimeError(f"{prefix} the compiler ({shown}) does not run: {exc.strerror or exc}") from None
    if result.returncode == 0:
        return
    code = result.returncode
    status = f"exited {code}" if code > 0 else f"died of signal {-code}"
    text = "\n".join(part.strip() for part in (result.stderr, result.stdout) if part.strip())
    if not text:
        raise RuntimeError(f"{prefix} the compiler ({shown}) {status} with no message")
    errors = [line.strip() for line in text.splitlines() if "error" in line.lower()] or [" ".join(text.split())]
    raise RuntimeError(f"{prefix} the compiler ({shown}) {status}: {'; '.join(errors)}"[:_REASON_CHARS])
