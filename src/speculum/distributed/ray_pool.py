"""A model served by a pool of Ray actors: enumeration's batched forwards spread over a cluster.

Each of ``workers`` Ray actors (one model replica per actor, the shape vLLM and SGLang use on Ray) loads the
same model: a :class:`ModelSpec` (the embedded default, a Hugging Face directory or a GGUF file) or any
zero-argument factory Ray can pickle. The pool is itself a protocol model (``next_logprobs``,
``next_logprobs_above`` when the model declares sparse rows, ``score_sequences``) and declares
``Capabilities(parallel_calls=2 * workers)``: a caller with many independent batches (a level of the
enumeration tree, cut into batches of sibling prefixes that share the prompt and first tokens) hands them
over together through :meth:`RayPool.map_calls`, and each batch runs whole on whichever actor is free. A
batch is never re-cut, so each result is computed by the same code on the same batch as locally: bitwise
the local model's result with the same thread count (the default), and exact, constrained and speculative
enumeration run on the pool unchanged and answer exactly as they do locally.

Sessions (``start``, incremental decoding) and the rest of a model's surface (``tokenizer``, ``encode``,
``decode``) come from a local copy of the model, loaded on first use.

Kernels: each actor reports the paths its products take (speculum's compiled kernels, where they run, and
the CPU flags that pick PyTorch's); a pool whose actors would multiply on other kernels than this process
is refused with a one-line reason, since its rows would not be bitwise the local model's.
``SPECULUM_KERNELS=off`` set here reaches every actor: PyTorch's kernels everywhere.

Faults: an actor that dies during a call (its process killed, its node lost) is replaced by a fresh actor
that loads the same model, and every batch queued on it runs again there; which actor computed a batch
never changes a result.

Example:
    >>> from functools import partial
    >>> from speculum.models.reference.tiny_transformer import TinyTransformer
    >>> with RayPool(partial(TinyTransformer, 16, seed=1), workers=2) as pool:   # doctest: +SKIP
    ...     rows = pool.next_logprobs([[1, 2], [1, 3], [4]])                      # (3, 16)
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from ..validation import InputError, check_int, check_optional_int
from ..models.memory.allocator import keep_freed_memory
from ..models.base import Capabilities, check_token_ids
from ..models.backends import DEFAULT_BACKEND, backend_named, backend_names, load_model

__all__ = ["RayPool", "ModelSpec", "PoolStats", "ClusterUnreachableError", "WorkerLostError", "ray_install_hint",
           "check_address", "kernel_mismatch", "CONNECT_TIMEOUT"]

# Replacements of a dead actor within one call before the call fails.
DEFAULT_MAX_RETRIES = 3
# Seconds a cluster's address gets to accept a connection (Ray's own client would retry far longer).
CONNECT_TIMEOUT = 3.0


def ray_install_hint() -> str:
    return "Ray is not installed: pip install 'speculum[ray]' (or `make install`, which installs it)"


class ClusterUnreachableError(ConnectionError):
    """The Ray cluster at the given address cannot be reached."""


class WorkerLostError(RuntimeError):
    """An actor slot kept dying: the call gave up after ``max_retries`` replacements."""


@dataclass(frozen=True)
class ModelSpec:
    """What each actor loads: ``load_model(name_or_path, backend=..., dtype=..., prepack=...)``, on a backend
    of :data:`~speculum.models.backends.BACKENDS` that runs on Ray (an unknown one is refused at once).

    Example:
        >>> ModelSpec("smollm2-135m").backend
        'hf'
    """

    name_or_path: str = "smollm2-135m"
    backend: str = DEFAULT_BACKEND
    dtype: str = "float32"
    prepack: bool = True

    def __post_init__(self) -> None:
        if not backend_named(self.backend).ray:   # an unknown backend: one line naming the known ones
            raise InputError(f"backend {self.backend!r} does not load in a Ray pool's actors (those that do: "
                             f"{', '.join(backend_names(lambda backend: backend.ray))})")

    def __call__(self) -> Any:
        # dtype and prepack reach the backends that take them (speculum.models.backends): the others ignore them.
        return load_model(self.name_or_path, backend=self.backend, dtype=self.dtype, prepack=self.prepack,
                          progress=False)


@dataclass
class WorkerStats:
    """One actor slot's share of the work (a replaced actor's slot keeps its counts)."""

    rows: int = 0            # prefixes / sequences computed
    calls: int = 0           # batched calls run
    seconds: float = 0.0     # time inside the model, measured in the actor


@dataclass
class PoolStats:
    """What the pool has done, as data (the CLI and benchmarks print it)."""

    workers: list[WorkerStats] = field(default_factory=list)
    calls: int = 0               # batched protocol calls served
    wall_seconds: float = 0.0    # wall time of those calls, as the caller saw it
    replaced: int = 0            # actors replaced after dying
    retries: int = 0             # calls run again on a replacement

    @property
    def busy_seconds(self) -> float:
        return sum(w.seconds for w in self.workers)

    def imbalance(self) -> float:
        """Largest relative deviation of an actor's model time from the mean (0 = perfectly even)."""
        seconds = [w.seconds for w in self.workers]
        mean = sum(seconds) / len(seconds) if seconds else 0.0
        return max(abs(s - mean) for s in seconds) / mean if mean > 0 else 0.0


class _Worker:
    """The body of one Ray actor: one model replica answering timed protocol calls."""

    def __init__(self, factory: Callable[[], Any], threads: int | None) -> None:
        self.allocator_tuned = keep_freed_memory()     # before the model's first large buffers
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(threads)     # for a backend that reads it when it loads
        self.model = factory()
        torch = sys.modules.get("torch")                      # the hf backend's, if the model loaded it
        if threads and torch is not None:
            torch.set_num_threads(threads)

    def describe(self) -> dict[str, Any]:
        model = self.model
        return {"vocab_size": int(model.vocab_size), "pid": os.getpid(), "allocator_tuned": self.allocator_tuned,
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "products": _product_paths(),
                **{name: getattr(model, name, None) for name in
                   ("bos_token_id", "eos_token_id", "max_context", "name", "capabilities")},
                "accepts_empty_prompt": bool(getattr(model, "accepts_empty_prompt", False))}

    def call(self, method: str, *args: Any) -> tuple[Any, float]:
        started = time.perf_counter()
        result = getattr(self.model, method)(*args)
        return result, time.perf_counter() - started


class RayPool:
    """A protocol model whose batched calls run on ``workers`` Ray actors, each holding the same model.

    Args:
        spec: what each actor loads — a model name or path (read as ``ModelSpec(spec)``), a
            :class:`ModelSpec`, or a zero-argument callable returning a protocol model (Ray must be able
            to pickle it: a ``functools.partial`` of a model class is the usual form).
        workers: number of actors.
        address: a running Ray cluster (``"HOST:PORT"``, ``"ray://HOST:PORT"`` or ``"auto"``); None starts
            a local one on this machine (or uses the one this process already runs).
        cpus_per_worker: CPUs (and threads) each actor gets; default: this machine's CPUs shared evenly for
            a local cluster, 1 on an existing cluster.
        threads: compute threads of each actor's model; default: the threads PyTorch uses in this process
            (float32 kernels may round differently with another thread count, so this default keeps the
            pool's rows bitwise equal to the local model's).
        max_retries: replacements of a dead actor within one call before ``WorkerLostError``.
        local: the model already loaded in this process from the same spec (else loaded on first use).

    Guarantee (exact): every call's result is what the model computes for that same call in this process
    (bitwise with the same thread count); enumeration on the pool answers as it does on the local model.
    Raises ``ImportError`` (Ray missing, with the install command) and :class:`ClusterUnreachableError`
    (one line, when ``address`` does not answer).
    """

    def __init__(self, spec: Any, workers: int, *, address: str | None = None,
                 cpus_per_worker: int | None = None, threads: int | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES, local: Any = None) -> None:
        try:
            import ray      # the ray extra, loaded when a pool starts
        except ImportError:
            raise ImportError(ray_install_hint()) from None
        self._ray = ray
        self.workers = check_int(workers, "workers", minimum=1)
        self.max_retries = check_int(max_retries, "max_retries", minimum=0)
        cpus_per_worker = check_optional_int(cpus_per_worker, "cpus_per_worker", minimum=1)
        if isinstance(spec, (str, os.PathLike)):
            spec = ModelSpec(str(spec))
        if not callable(spec):
            raise InputError(f"spec must be a model name or path, a ModelSpec or a zero-argument model factory, "
                             f"got {type(spec).__name__}")
        self.spec = spec
        self._owns_cluster = False
        self._local: Any = local
        self._actors: list[Any] = []
        self.stats = PoolStats(workers=[WorkerStats() for _ in range(self.workers)])
        self._connect(address)
        if cpus_per_worker is None:
            cpus_per_worker = max(1, (os.cpu_count() or 1) // self.workers) if self._owns_cluster else 1
        self.cpus_per_worker = cpus_per_worker
        free = ray.available_resources().get("CPU", 0.0)
        if free < self.workers * cpus_per_worker:
            self.close()
            raise InputError(f"the Ray cluster has {free:g} free CPUs; {self.workers} workers of {cpus_per_worker} "
                             f"CPUs each need {self.workers * cpus_per_worker} (use fewer workers or "
                             "cpus_per_worker)")
        self.threads = check_optional_int(threads, "threads", minimum=1) or _local_threads()
        try:
            self._actors = [self._new_actor() for _ in range(self.workers)]
            infos = ray.get([actor.describe.remote() for actor in self._actors])
            reports = [worker["products"] for worker in infos]
            mismatch = kernel_mismatch(reports, _product_paths(needed=any(r is not None for r in reports)))
            if mismatch is not None:
                raise InputError(mismatch)
        except BaseException:
            self.close()
            raise
        info = infos[0]
        self.vocab_size: int = info["vocab_size"]
        self.bos_token_id = info["bos_token_id"]
        self.eos_token_id = info["eos_token_id"]
        self.max_context = info["max_context"]
        self.accepts_empty_prompt = info["accepts_empty_prompt"]
        self.name = f"{info['name'] or 'model'} on {self.workers} Ray worker{'s' * (self.workers > 1)}"
        declared = info["capabilities"] if isinstance(info["capabilities"], Capabilities) else Capabilities()
        # The batched calls run remotely; sessions come from the local copy, which has the same declaration
        # except cache sharing between two models (the pool's sessions are the local model's own).
        self.capabilities = replace(declared, shares_prefix_cache=False,
                                    parallel_calls=_QUEUED_PER_ACTOR * self.workers)

    # ------------------------------------------------------------------------------------- cluster
    def _connect(self, address: str | None) -> None:
        ray = self._ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # nothing leaves the machine
        # Ray runs workers at nice 15 by default; here they do the work and the caller mostly waits, and a
        # multithreaded forward at low priority stalls whenever any daemon wakes (read by a cluster we start).
        os.environ.setdefault("RAY_worker_niceness", "0")
        if address is None and ray.is_initialized():
            return
        if address is not None:
            check_address(address)
        try:
            ray.init(address=address, num_cpus=None if address else os.cpu_count(), include_dashboard=False,
                     logging_level=logging.ERROR, ignore_reinit_error=True)
        except (ConnectionError, TimeoutError, RuntimeError) as exc:
            where = f"at {address}" if address else "on this machine"
            raise ClusterUnreachableError(f"cannot reach a Ray cluster {where}: {_one_line(exc)}") from None
        self._owns_cluster = address is None

    def _new_actor(self) -> Any:
        # Workers share the machine's cores with each other and the caller: OpenMP threads that spin while
        # they wait would take cores from the threads doing work, so they wait passively (unless the caller
        # chose a policy); the variable is read when torch loads, so it is set in the actor's environment.
        policy = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        if "SPECULUM_KERNELS" in os.environ:       # kernels off here: off on every worker too
            policy["SPECULUM_KERNELS"] = os.environ["SPECULUM_KERNELS"]
        remote = self._ray.remote(_Worker).options(num_cpus=self.cpus_per_worker, max_restarts=0,
                                                   runtime_env={"env_vars": policy})
        return remote.remote(self.spec, self.threads)

    def close(self) -> None:
        """Stop the actors (and the local cluster this pool started)."""
        # After the cluster has gone (ray.shutdown, interpreter exit) there is nothing to stop, and any Ray
        # call would start a fresh local instance.
        actors = self._actors if self._ray.is_initialized() else []
        for actor in actors:
            try:
                self._ray.kill(actor)
            except Exception:   # already gone: nothing to stop
                pass
        self._actors = []
        if self._owns_cluster and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_cluster = False

    def __enter__(self) -> "RayPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """The process id of each live actor (what a fault test kills)."""
        return [info["pid"] for info in self.worker_info()]

    def worker_info(self) -> list[dict[str, Any]]:
        """What each live actor reports of itself: ``pid``, ``allocator_tuned``, ``omp_wait_policy``,
        ``products`` (its product paths, None off the PyTorch backend), and
        its model's ``vocab_size``, ``name``, ``capabilities`` and special tokens."""
        return self._ray.get([a.describe.remote() for a in self._actors])

    # -------------------------------------------------------------------------------- local surface
    @property
    def local(self) -> Any:
        """The local copy of the model (sessions, tokenizer), loaded on first use."""
        if self._local is None:
            self._local = self.spec()
        return self._local

    def start(self, prompt: Sequence[int]) -> Any:
        """An incremental session on the local copy (decoding does not run on the pool)."""
        return self.local.start(prompt)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the pool does not define: tokenizer, encode, decode, extend_sessions...
        if name.startswith("_") or name in ("spec", "stats"):
            raise AttributeError(name)
        return getattr(self.local, name)

    # ------------------------------------------------------------------------------ batched protocol
    def next_logprobs(self, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        """``(batch, vocab)`` exact next-token log-probs: the batch runs whole on one actor."""
        return self.map_calls("next_logprobs", [(prefixes,)])[0]

    def next_logprobs_above(self, prefixes: Sequence[Sequence[int]], min_logprobs: Sequence[float]
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The model's sparse rows (see ``Capabilities.sparse_rows``): the batch runs whole on one actor."""
        return self.map_calls("next_logprobs_above", [(prefixes, min_logprobs)])[0]

    def score_sequences(self, sequences: Sequence[Sequence[int]], prompt: Sequence[int] = ()) -> np.ndarray:
        """``(batch,)`` exact total log p(sequence | prompt) by teacher forcing, on one actor."""
        return self.map_calls("score_sequences", [(sequences, prompt)])[0]

    def map_calls(self, method: str, calls: Sequence[tuple]) -> list[Any]:
        """``[getattr(model, method)(*args) for args in calls]``, the calls spread over the actors.

        Each call runs whole on one actor — the batch the caller formed is never re-cut, so every result is
        bitwise what the local model returns for it (same code, same batch, same thread count). Calls go to
        whichever actor is free (two queued per actor keep each busy); a call whose actor dies runs again on
        a fresh one. Results come back in the order of ``calls``.
        """
        if method not in _METHODS:
            raise InputError(f"map_calls runs one of {', '.join(_METHODS)}, got {method!r}")
        if method == "next_logprobs_above" and not self.capabilities.sparse_rows:
            raise InputError(f"{self.name} does not offer next_logprobs_above (no sparse rows)")
        calls = [self._checked(method, tuple(args)) for args in calls]
        ray = self._ray
        started = time.perf_counter()
        results: list[Any] = [None] * len(calls)
        attempts = [0] * len(calls)
        queue = list(range(len(calls)))[::-1]                 # next call to submit at the end
        pending: dict[Any, tuple[int, int]] = {}              # ref -> (call, actor slot)

        def submit(slot: int) -> None:
            k = queue.pop()
            pending[self._actors[slot].call.remote(method, *calls[k])] = (k, slot)

        # The least busy actors first: a call alone (a small level) goes to the one that has worked least.
        by_load = sorted(range(self.workers), key=lambda w: (self.stats.workers[w].seconds, w))
        for _ in range(_QUEUED_PER_ACTOR):
            for slot in by_load:
                if queue:
                    submit(slot)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            k, slot = pending.pop(ready[0])
            try:
                result, seconds = ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:       # the model refused the call: the caller's error
                cause = getattr(exc, "cause", None)
                raise (cause if isinstance(cause, BaseException) else exc) from None
            except ray.exceptions.RayActorError as exc:      # the actor died: replace it, run the call again
                attempts[k] += 1
                if attempts[k] > self.max_retries:
                    raise WorkerLostError(f"worker {slot} died {attempts[k]} times during one {method} call: "
                                          f"{_one_line(exc)}") from None
                # Every call queued on the dead actor runs again on its replacement, in submission order.
                lost = [k] + [other for other, where in pending.values() if where == slot]
                for ref in [ref for ref, (_, where) in pending.items() if where == slot]:
                    del pending[ref]
                queue.extend(sorted(lost, reverse=True))
                self._actors[slot] = self._new_actor()
                self.stats.replaced += 1
                self.stats.retries += len(lost)
                for _ in range(_QUEUED_PER_ACTOR):
                    if queue:
                        submit(slot)
                continue
            results[k] = result
            worker = self.stats.workers[slot]
            worker.rows += len(calls[k][0])
            worker.calls += 1
            worker.seconds += seconds
            if queue:
                submit(slot)
        self.stats.calls += len(calls)
        self.stats.wall_seconds += time.perf_counter() - started
        return results

    # ------------------------------------------------------------------------------------ internals
    def _checked(self, method: str, args: tuple) -> tuple:
        """Token ids checked here, so an error names the caller's index and nothing ships that the model
        would refuse."""
        items = [check_token_ids(item, self.vocab_size, name=f"{_ITEMS[method]}[{i}]")
                 for i, item in enumerate(args[0])]
        if method == "next_logprobs_above":
            floors = np.asarray(args[1], dtype=np.float64).reshape(-1)
            if len(floors) != len(items) or np.isnan(floors).any():
                raise InputError(f"min_logprobs must hold one number per prefix ({len(items)}), got {len(floors)}")
            return items, floors
        if method == "score_sequences":
            return items, check_token_ids(args[1] if len(args) > 1 else (), self.vocab_size, name="prompt")
        return (items,)


_METHODS = ("next_logprobs", "next_logprobs_above", "score_sequences")
_ITEMS = {"next_logprobs": "prefixes", "next_logprobs_above": "prefixes", "score_sequences": "sequences"}
# Calls queued on each actor at once: one running, one waiting, so an actor never idles between calls.
_QUEUED_PER_ACTOR = 2


def _local_threads() -> int:
    """The thread count PyTorch uses in this process (its default when not yet imported)."""
    try:
        import torch   # the hf backend's own dependency; imported here only to read its setting
    except ImportError:
        return os.cpu_count() or 1
    return int(torch.get_num_threads())


def check_address(address: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Raise a one-line :class:`ClusterUnreachableError` unless ``HOST:PORT`` (or ``ray://HOST:PORT``) accepts a
    TCP connection within ``timeout`` seconds, and ``InputError`` for an address of another form; ``auto`` and
    ``local...`` pass (Ray finds those itself). Needs no Ray: the command line checks before anything starts."""
    if address == "auto" or address.startswith("local"):
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise InputError(f"a Ray address is HOST:PORT, ray://HOST:PORT or auto, got {address!r}")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ClusterUnreachableError(f"cannot reach the Ray cluster at {address}: {reason}") from None


def _product_paths(needed: bool = False) -> dict[str, Any] | None:
    """This process's product paths (:func:`~speculum.models.hf.kernels.products.product_paths`) where its model runs
    on the PyTorch backend (or ``needed``), else None: other backends' numbers do not depend on them."""
    if not needed and "speculum.models.hf.kernels.products" not in sys.modules:
        return None
    from ..models.hf.kernels.products import product_paths  # the hf backend (torch): only where a model uses it

    return product_paths()


def kernel_mismatch(workers: Sequence[dict[str, Any] | None], local: dict[str, Any] | None) -> str | None:
    """Why the workers' products would not be bitwise this process's (one line), else None. ``workers``
    and ``local`` are product-path reports (None: a model off the PyTorch backend, nothing to compare)."""
    for index, report in enumerate(workers):
        if report is None or local is None or report == local:
            continue
        key = next(key for key in sorted(set(report) | set(local)) if report.get(key) != local.get(key))
        return (f"Ray worker {index} multiplies on other kernels than this process ({key}: {report.get(key)!r} "
                f"there, {local.get(key)!r} here), so its rows would not be bitwise the local model's; set "
                "SPECULUM_KERNELS=off here and on every machine of the cluster to use PyTorch's kernels everywhere")
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
