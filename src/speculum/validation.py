"""The argument validators every public entry point uses: one place, one wording.

Each returns the value in its canonical Python type or raises :class:`InputError` (a ``ValueError``) naming
the argument. Nothing
is coerced: ``True`` is not an integer here, ``2.0`` is not an integer, and ``"3"`` is not a number.
Token-id checks live with the model protocol (:func:`speculum.models.base.check_token_ids`).

Example:
    >>> check_int(3, "k", minimum=1)
    3
    >>> check_int(True, "k", minimum=1)  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    InputError: k must be an integer >= 1, got True
"""
from __future__ import annotations

import math
import operator
from numbers import Real
from typing import Any

import numpy as np

__all__ = ["InputError", "check_int", "check_optional_int", "check_number", "check_logprob"]


class InputError(ValueError):
    """A value given to speculum is invalid (a wrong argument, an off-support sequence, a model that
    breaks the protocol). Every check the library makes on purpose raises it, so callers (the CLI) can tell
    bad input, shown as one line, from a bug, which keeps its traceback. A ``ValueError`` for existing
    ``except ValueError`` code."""


def check_int(value: Any, name: str, *, minimum: int | None = None) -> int:
    """``value`` as a Python int (Python or NumPy integer; never a bool or a float), ``>= minimum``."""
    bound = "" if minimum is None else f" >= {minimum}"
    if isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be an integer{bound}, got {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise InputError(f"{name} must be an integer{bound}, got {value!r}") from None
    if minimum is not None and result < minimum:
        raise InputError(f"{name} must be an integer{bound}, got {result}")
    return result


def check_optional_int(value: Any, name: str, *, minimum: int | None = None) -> int | None:
    """None, or :func:`check_int`."""
    return None if value is None else check_int(value, name, minimum=minimum)


def check_number(value: Any, name: str, *, minimum: float | None = None, maximum: float | None = None,
                 above: float | None = None, finite: bool = True) -> float:
    """``value`` as a float: a real number (never a bool), finite unless ``finite=False`` (NaN is always
    refused), ``>= minimum``, ``<= maximum`` and ``> above`` where given."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (Real, np.floating, np.integer)):
        raise InputError(f"{name} must be a number, got {value!r}")
    result = float(value)
    if math.isnan(result):
        raise InputError(f"{name} is NaN: it must be a number")
    if finite and math.isinf(result):
        raise InputError(f"{name} must be a finite number, got {result}")
    if minimum is not None and result < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {result}")
    if maximum is not None and result > maximum:
        raise InputError(f"{name} must be <= {maximum}, got {result}")
    if above is not None and not result > above:
        raise InputError(f"{name} must be > {above}, got {result}")
    return result


def check_logprob(value: Any, name: str = "min_log_prob") -> float:
    """A log-probability threshold: any number but NaN (``-inf`` and ``+inf`` are meaningful bounds)."""
    return check_number(value, name, finite=False)
