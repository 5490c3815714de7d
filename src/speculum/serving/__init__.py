"""Serving many requests: :class:`Engine` (a bounded queue of generation jobs on one worker) and
:func:`create_app` (an OpenAI-compatible HTTP API over it, ``speculum serve``). FastAPI and uvicorn are
imported only by :func:`create_app` (the ``serve`` extra)."""
from __future__ import annotations

from .engine import Delta, Engine, EngineBusy, EngineClosed, EngineMetrics, GenerationRequest, Job

__all__ = ["Engine", "EngineBusy", "EngineClosed", "EngineMetrics", "GenerationRequest", "Delta", "Job",
           "create_app"]


def create_app(*args, **kwargs):
    """See :func:`speculum.serving.openai_api.create_app`."""
    from .openai_api import create_app as _create_app

    return _create_app(*args, **kwargs)
