"""Serving many requests: :class:`Engine` (a bounded queue of generation jobs on one worker) and
:func:`create_app` (an OpenAI-compatible HTTP API over it, ``speculum serve``), :func:`serve_on_this_thread`
(HTTP on a thread, the engine on the caller's). FastAPI and uvicorn are imported only by these two (the
``serve`` extra)."""
from __future__ import annotations

from .engine import Delta, Engine, EngineBusy, EngineClosed, EngineMetrics, GenerationRequest, Job

__all__ = ["Engine", "EngineBusy", "EngineClosed", "EngineMetrics", "GenerationRequest", "Delta", "Job",
           "create_app", "serve_on_this_thread"]


def create_app(*args, **kwargs):
    """See :func:`speculum.serving.openai_api.create_app`."""
    from .openai_api import create_app as _create_app

    return _create_app(*args, **kwargs)


def serve_on_this_thread(*args, **kwargs):
    """See :func:`speculum.serving.openai_api.serve_on_this_thread`."""
    from .openai_api import serve_on_this_thread as _serve

    return _serve(*args, **kwargs)
