"""The machine a benchmark ran on, named with every figure it prints."""
from __future__ import annotations

from speculum.models.cpu import cpu_name

__all__ = ["cpu_name"]
