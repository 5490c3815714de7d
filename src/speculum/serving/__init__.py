"""Serving many requests: :class:`Engine` (a bounded set of generation jobs on one worker),
:func:`create_app` (an OpenAI-compatible HTTP API over it, ``speculum serve``), :class:`ServerLimits` (what one
request may ask), :func:`serve_on_this_thread` (HTTP on a thread, the engine on the caller's, with a graceful
shutdown). FastAPI, pydantic and uvicorn are imported only by the HTTP side (the ``serve`` extra)."""
from __future__ import annotations

from .engine import Delta, Engine, EngineBusy, EngineClosed, EngineMetrics, GenerationRequest, Job
from .lifecycle import serve_on_this_thread

__all__ = ["Engine", "EngineBusy", "EngineClosed", "EngineMetrics", "GenerationRequest", "Delta", "Job",
           "create_app", "serve_on_this_thread", "ServerLimits"]


def create_app(*args, **kwargs):
    """See :func:`speculum.serving.openai_api.create_app`."""
    from .openai_api import create_app as _create_app     # FastAPI: the serve extra, loaded when asked for

    return _create_app(*args, **kwargs)


def __getattr__(name: str):
    if name == "ServerLimits":          # pydantic is part of the serve extra: imported when asked for
        from .schema import ServerLimits      # pydantic: the serve extra

        return ServerLimits
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
