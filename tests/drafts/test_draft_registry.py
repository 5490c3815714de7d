"""One draft registry serves decoding and enumeration: each kind says what it is for, how its spec is checked
(without loading) and how it is built."""
from __future__ import annotations

import doctest
import importlib
import subprocess
import sys

import numpy as np
import pytest

from speculum.drafts import (DECODING, DRAFT_KINDS, DRAFT_REGISTRY, ENUMERATION, ENUMERATION_DRAFTS, NGRAM_ORDER,
                             NGramProposer, PromptLookup, check_draft_spec, draft_kinds, make_draft,
                             make_enumeration_draft, sample_continuations)
from speculum.models import MarkovModel, NGramModel

TARGET = MarkovModel.random(5, seed=0, eos_token_id=4)


def test_both_lists_are_views_of_the_one_registry():
    labels = [kind.label for kind in DRAFT_REGISTRY]
    assert len(labels) == len(set(labels))
    assert list(DRAFT_KINDS) == ["none", "lookup", "ngram", "int8", "bf16", "layers:K", "PATH"]
    assert ENUMERATION_DRAFTS == ("none", "ngram", "llamacpp", "llamacpp:GGUF", "int8", "bf16", "layers:K", "PATH")
    assert DRAFT_KINDS == draft_kinds(DECODING) and ENUMERATION_DRAFTS == tuple(draft_kinds(ENUMERATION))
    for kind in DRAFT_REGISTRY:   # a kind refused for a purpose says why
        assert set(kind.uses) | set(kind.refusals) == {DECODING, ENUMERATION}


def test_specs_are_checked_per_purpose_without_loading():
    assert check_draft_spec(" Layers:3 ", purpose=ENUMERATION) == "Layers:3"
    assert check_draft_spec("llamacpp", purpose=ENUMERATION) == "llamacpp"
    with pytest.raises(ValueError, match="proposes fixed tokens; enumeration needs a draft model"):
        check_draft_spec("lookup", purpose=ENUMERATION)
    with pytest.raises(ValueError, match="enumeration draft"):
        check_draft_spec("llamacpp", purpose=DECODING)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        check_draft_spec("llamacpp:/no/such/file.gguf", purpose=ENUMERATION)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_draft_spec("./no/such/model", purpose=ENUMERATION)
    for spec, words in [("layers:0", ">= 1"), ("layers:two", "integer K"), ("", "non-empty")]:
        with pytest.raises(ValueError, match=words):
            check_draft_spec(spec)


def test_an_unknown_draft_lists_the_kinds_of_its_purpose():
    with pytest.raises(ValueError, match="llamacpp:GGUF") as enumeration:
        make_enumeration_draft("lookahead", TARGET, prompt=[0], length=2)
    assert "lookup" not in str(enumeration.value)
    with pytest.raises(ValueError, match="lookup") as decoding:
        make_draft("lookahead", TARGET)
    assert "llamacpp" not in str(decoding.value)
    with pytest.raises(ValueError, match="draft model"):
        make_enumeration_draft("lookup", TARGET, prompt=[0], length=2)


def test_the_same_name_builds_what_each_purpose_needs():
    assert make_draft("none", TARGET) is None and make_draft(None, TARGET) is None
    assert make_enumeration_draft("none", TARGET, prompt=[0], length=2) is None
    assert isinstance(make_draft("lookup", TARGET), PromptLookup)
    assert isinstance(make_draft("ngram", TARGET, corpus=[[0, 1, 2]]), NGramProposer)
    # Enumeration's n-gram is a distribution fitted to the target's samples: deterministic in its seed.
    fitted = make_enumeration_draft("ngram", TARGET, prompt=[0, 1], length=3, eos=4, n_samples=16, seed=3)
    again = make_enumeration_draft("ngram", TARGET, prompt=[0, 1], length=3, eos=4, n_samples=16, seed=3)
    assert isinstance(fitted, NGramModel) and fitted.vocab_size == 5 and fitted.eos_token_id == 4
    rows = fitted.next_logprobs([[0, 1], [0, 1, 2]])
    np.testing.assert_array_equal(rows, again.next_logprobs([[0, 1], [0, 1, 2]]))
    samples = sample_continuations(TARGET, [0, 1], length=3, n=16, rng=np.random.default_rng(3), eos=4)
    assert len(samples) == 16 and all(1 <= len(s) <= 3 for s in samples)
    with pytest.raises(ValueError, match="Hugging Face"):
        make_enumeration_draft("int8", TARGET, prompt=[0], length=2)


def test_the_fitted_ngram_is_the_ngram_model_of_the_targets_samples():
    samples = sample_continuations(TARGET, [0, 1], length=3, n=16, rng=np.random.default_rng(3), eos=4)
    expected = NGramModel.fit([[0, 1] + sample for sample in samples], NGRAM_ORDER, 5, eos_token_id=4)
    fitted = make_enumeration_draft("ngram", TARGET, prompt=[0, 1], length=3, eos=4, n_samples=16, seed=3)
    prefixes = [[0, 1], [0, 1, 2], [3], [0, 1, 2, 3]]
    np.testing.assert_array_equal(fitted.next_logprobs(prefixes), expected.next_logprobs(prefixes))


def test_models_never_imports_the_drafts_floor_and_still_names_the_proposers():
    """Drafts sit a floor above models: ``speculum.models`` names the proposers lazily, so importing it
    (or a backend) imports no draft module, and the names it gives are the drafts' own."""
    code = ("import sys, speculum.models, speculum.models.backends, speculum.models.hf_loading; "
            "assert not [m for m in sys.modules if m.startswith('speculum.drafts')], sorted(sys.modules); "
            "import speculum.drafts as d; "
            "assert (speculum.models.PromptLookup, speculum.models.NGramProposer) == (d.PromptLookup, d.NGramProposer)")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("module", ["speculum.drafts", "speculum.drafts.registry", "speculum.drafts.proposers",
                                    "speculum.drafts.ngram_fit"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
