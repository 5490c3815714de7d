"""The command line's progress bars: the library reports progress through callbacks, the CLI draws them.

Bars go to stderr and only on a terminal: in a log file or a pipe they are noise of carriage returns.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from tqdm.auto import tqdm

__all__ = ["conversion_bar", "index_bar", "choices_bar", "loading_progress", "quiet_progress_bars"]


def conversion_bar() -> Callable[[Any], None]:
    """A ``load_model(progress=...)`` callback drawing a tqdm bar of the embedded model's one-time
    conversion (:class:`speculum.models.hf_loading.ConversionProgress` events). The bar appears with the first
    event, so a model already in the cache draws nothing."""
    bar = None

    def update(event: Any) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=event.total, desc=f"converting {event.model} (once)", unit="step")
        bar.set_postfix_str(event.stage)  # drawn at once: a stage lasts seconds
        bar.update(event.step - bar.n)
        if event.final:
            bar.close()

    return update


def index_bar(**tqdm_kwargs: Any) -> Callable[[Any], None]:
    """An enumeration ``progress`` callback drawing a tqdm bar of forwarded prefixes
    (:class:`speculum.enumeration.enumerable.BuildProgress` events); ``tqdm_kwargs`` go to ``tqdm``."""
    bar = tqdm(unit="prefix", desc="enumeration index", **tqdm_kwargs)

    def update(event: Any) -> None:
        bar.update(event.forwards - bar.n)
        # refresh=False: the next rate-limited update draws it; refreshing would redraw on every event.
        bar.set_postfix(level=event.level, budget_bits=f"{event.budget_bits:.1f}", refresh=False)

    return update


def choices_bar(**tqdm_kwargs: Any) -> Callable[[Any], None]:
    """A ``score_choices`` ``progress`` callback drawing a tqdm bar of the label trie's forwarded prefixes
    (:class:`speculum.enumeration.labels.ScoringProgress` events); ``tqdm_kwargs`` go to ``tqdm``. The bar
    appears with the first batch, when the total is known."""
    bar = None

    def update(event: Any) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=event.total, unit="prefix", desc="scoring choices", **tqdm_kwargs)
        bar.update(event.forwards - bar.n)
        if event.forwards >= event.total:
            bar.close()

    return update


def quiet_progress_bars() -> None:
    """Turn off transformers' and huggingface_hub's progress bars unless stderr is a terminal.

    Called just before a model loads (transformers is imported by then anyway).
    """
    if sys.stderr.isatty():
        return
    try:
        from huggingface_hub.utils import disable_progress_bars   # the llm extra: silenced where installed
        from transformers.utils import logging as hf_logging       # the llm extra: silenced where installed
    except ImportError:  # the hf backend is not installed: nothing to silence
        return
    hf_logging.disable_progress_bar()
    disable_progress_bars()


def loading_progress() -> Callable[[Any], None] | bool:
    """``load_model``'s ``progress`` argument for the CLI: a conversion bar on a terminal, else ``False``
    (nothing reported, transformers' own bars off too)."""
    quiet_progress_bars()
    return conversion_bar() if sys.stderr.isatty() else False
