"""Running a model's forwards elsewhere: :class:`RayPool` (replicas of a model on Ray actors, answering the
batched calls of the protocol bitwise as the local model would). Ray is the ``ray`` extra, imported when a
pool starts."""
from __future__ import annotations

from .ray_pool import ClusterUnreachableError, ModelSpec, RayPool, ray_install_hint

__all__ = ["RayPool", "ModelSpec", "ClusterUnreachableError", "ray_install_hint"]
