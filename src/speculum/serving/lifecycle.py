"""Running a server process: HTTP on a thread, the engine on the caller's, and a graceful shutdown on SIGINT /
SIGTERM that ends every open response properly within a grace period.

Example:
    >>> server = uvicorn.Server(uvicorn.Config(app, port=8000,                     # doctest: +SKIP
    ...                                        timeout_graceful_shutdown=grace + 2))
    >>> serve_on_this_thread(server, engine, grace=5.0)                              # doctest: +SKIP
"""
from __future__ import annotations

import gc
import signal
import threading
import time
from typing import Any

from .engine import Engine

__all__ = ["serve_on_this_thread", "DEFAULT_SHUTDOWN_SECONDS"]

DEFAULT_SHUTDOWN_SECONDS = 5.0


def serve_on_this_thread(server: Any, engine: Engine, *, grace: float = DEFAULT_SHUTDOWN_SECONDS) -> bool:
    """Run ``server`` (a ``uvicorn.Server`` over :func:`~speculum.serving.create_app`'s app) on a thread of its
    own and ``engine``'s jobs on the calling thread (an engine built with ``background=False``: see its
    docstring for why), until the server stops. Returns whether the server started (False: it could not
    listen; uvicorn has logged why).

    From the main thread, SIGINT / SIGTERM start a graceful shutdown: new requests get 503 (the server keeps
    listening meanwhile), the engine keeps generating the admitted ones for up to ``grace`` seconds, then
    ends those left with an error event (a stream then sends it and ``[DONE]``; a waiting non-streamed
    request gets 503), uvicorn stops listening and closes the connections (give its ``timeout_graceful_shutdown`` a margin over ``grace``), the app's shutdown closes
    the engine, and the signal is raised again with its previous handler, so the process ends as stopped by
    it (exit status 130 / 143 in a shell).

    While it serves, the objects that exist when it starts are frozen (``gc.freeze``), so that garbage
    collections do not walk the loaded model at every full pass; they are unfrozen when it returns. A
    process that froze objects itself keeps its own freeze: then nothing is frozen or unfrozen here.
    """

    def http() -> None:
        try:
            server.run()
        except SystemExit:               # uvicorn exits when it cannot listen, after logging why
            pass
        finally:
            engine.close(timeout=0)      # the server stopped (or never started): end engine.run()

    received: list[int] = []

    def on_signal(sig: int, frame: Any) -> None:
        # The handler runs on this thread between two bytecodes of the engine's loop, which may hold the
        # engine's locks there (its queue's mutex, its metrics lock): the drain, which takes them, runs on a
        # thread of its own. uvicorn's handle_exit only sets flags.
        received.append(sig)
        threading.Thread(target=drain, args=(sig, frame), name="speculum-drain", daemon=True).start()

    def drain(sig: int, frame: Any) -> None:
        engine.drain(grace)
        # uvicorn stops listening as soon as it is told to exit: until the admitted requests are done (or
        # the grace period is over) it keeps answering, and a request arriving meanwhile gets its 503.
        deadline = time.monotonic() + grace
        while engine.admitted and time.monotonic() < deadline:
            time.sleep(0.02)
        server.handle_exit(sig, frame)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    # What is loaded by now (the model, the libraries' objects) lives as long as the server: a full garbage
    # collection walks all of it, with PyTorch and transformers loaded hundreds of thousands of objects, and
    # stalls every open stream. Frozen, collections walk only what serving creates.
    freezes = gc.get_freeze_count() == 0
    if freezes:
        gc.collect()
        gc.freeze()
    thread = threading.Thread(target=http, name="speculum-http", daemon=True)
    thread.start()
    try:
        engine.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.should_exit = True
        thread.join()
        if freezes:
            gc.unfreeze()
    # As uvicorn does: once shut down, the signal takes its usual course (exit status 130 / 143 in a shell).
    for sig in reversed(received):
        signal.raise_signal(sig)
    return bool(server.started)
