"""The PyTorch backend's log-prob formula (speculum.models.hf.logprobs).

Invariants: ``log_mass`` is ``torch.logsumexp`` of the float64 rows to float64 rounding, whatever the row
count, the values' range and the ``-inf`` entries, and each row's value is bitwise the same alone, in any
batch and at any thread count; ``entries_at_least`` returns exactly the entries and the order of
``torch.nonzero(logits >= floors[:, None])`` for any width (a multiple of its block or not) and any floors.
"""
from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from speculum.decoding.drafter import checked_rows  # noqa: E402
from speculum.models.hf.logprobs import entries_at_least, log_mass, logprob_rows  # noqa: E402
from speculum.validation import InputError  # noqa: E402


@st.composite
def logit_rows(draw, max_rows: int = 70, max_width: int = 200):
    """``(rows, width)`` float32 logits: random scale and offset, some entries ``-inf``, some rows tied."""
    rows, width = draw(st.integers(1, max_rows)), draw(st.integers(1, max_width))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(rows, width, generator=generator) * draw(st.sampled_from([1e-3, 1.0, 30.0]))
    logits += draw(st.sampled_from([0.0, -1e4, 1e4]))
    masked = torch.rand(rows, width, generator=generator) < draw(st.sampled_from([0.0, 0.3, 0.95]))
    masked[:, 0] = False                                     # every row keeps a finite entry
    logits[masked] = float("-inf")
    if draw(st.booleans()):
        logits = logits.round()                              # ties within rows
    return logits


@given(logit_rows())
@settings(max_examples=150, deadline=None)
def test_log_mass_is_logsumexp_in_float64_and_each_row_the_same_alone(logits):
    expected = torch.logsumexp(logits.double(), dim=-1)
    got = log_mass(logits)
    assert torch.allclose(got, expected, rtol=1e-14, atol=0)
    assert torch.equal(log_mass(logits.double()), got)                  # float32 rows widen exactly
    for row in {0, len(logits) // 2, len(logits) - 1}:
        assert torch.equal(log_mass(logits[row:row + 1]), got[row:row + 1])


def test_a_vocabulary_wide_row_is_the_same_alone_in_a_batch_and_at_any_thread_count():
    """A lone row's reduction is where PyTorch splits the work across its threads: the mass must not
    notice (ROW-CANONICAL)."""
    logits = torch.randn(9, 49_155, generator=torch.Generator().manual_seed(0)) * 5
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(torch.cat([log_mass(logits), *(log_mass(logits[i:i + 1]) for i in range(9)),
                                      log_mass(logits[2:7])]))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(result, results[0]) for result in results)
    assert torch.equal(results[0][9:18], results[0][:9]) and torch.equal(results[0][18:], results[0][2:7])


def test_log_mass_names_nan_and_infinite_logits_and_takes_no_rows():
    assert log_mass(torch.zeros(0, 5)).shape == (0,)
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(3, 5)
        logits[1, 2] = bad
        with pytest.raises(InputError, match="NaN or infinite"):
            log_mass(logits)


@given(logit_rows())
@settings(max_examples=60, deadline=None)
def test_logprob_rows_are_the_widened_logits_minus_the_mass_for_float32_and_float64(logits):
    """The one formula, ``logits.double() - log_mass(logits)``, bitwise, whether the rows come as float32, as
    the same values in float64, or as float64 values float32 cannot hold (another path: close)."""
    expected = (logits.double() - log_mass(logits)[:, None]).numpy()
    assert (logprob_rows(logits) == expected).all() and (logprob_rows(logits.double()) == expected).all()
    finer = logits.double() + 1e-12 * torch.rand(logits.shape, dtype=torch.float64)
    assert torch.allclose(log_mass(finer), torch.logsumexp(finer, dim=-1), rtol=1e-14, atol=0)


@given(logit_rows())
@settings(max_examples=60, deadline=None)
def test_logprob_rows_pass_the_decoding_loops_full_check(logits):
    """What the PyTorch model's ``Capabilities.normalised_rows`` promises the decoding loop, which then skips
    its own check: the rows pass it (normalised, no NaN or +inf)."""
    rows = logprob_rows(logits)
    checked_rows(rows, rows.shape[0], rows.shape[1], "the model")


def test_a_row_of_only_minus_infinity_is_refused_like_nan():
    with pytest.raises(InputError, match="NaN or infinite"):
        log_mass(torch.full((2, 40), float("-inf")))
    with pytest.raises(InputError, match="NaN or infinite"):
        logprob_rows(torch.tensor([[0.0, float("nan")]]))


@given(logit_rows(max_width=300), st.data())
@example(torch.full((2, 64), float("-inf")), None)          # a whole block of -inf: its maximum is -inf
@settings(max_examples=200, deadline=None)
def test_entries_at_least_are_nonzero_of_the_comparison_in_its_order(logits, data):
    rows = logits.shape[0]
    if data is None:
        floors = torch.tensor([float("-inf"), 0.0])
    else:
        # Floors at entries of the row (ties with the floor), between them, above all and -inf.
        picks = data.draw(st.lists(st.sampled_from(["entry", "offset", "above", "-inf"]), min_size=rows,
                                   max_size=rows))
        floors = torch.empty(rows)
        for i, pick in enumerate(picks):
            column = data.draw(st.integers(0, logits.shape[1] - 1))
            floors[i] = {"entry": logits[i, column], "offset": logits[i, column] - 0.5,
                         "above": logits[i].max() + 1.0, "-inf": float("-inf")}[pick]
    expected = torch.nonzero(logits >= floors[:, None], as_tuple=True)
    got = entries_at_least(logits, floors)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
