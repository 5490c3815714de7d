"""Formats: a regular expression or a label set read as the token sequences that spell its members.

One concept, from a pattern to the tokens allowed next: a format's language over characters, then over a
vocabulary's tokens. Nothing here knows an index or a model's probabilities: an index only asks the
automaton which tokens a prefix may take next. The modules import nothing else of
:mod:`speculum.enumeration`, so the package could stand on its own.

* :mod:`.constraint` — ``Regex`` and ``Choices``, what a user passes as ``constraint=``, and
  ``compile_for``, which turns either into a token automaton over a model's vocabulary;
* :mod:`.charfsm` — the pattern's deterministic automaton over characters, within a state budget;
* :mod:`.spelling` — a vocabulary read as characters, walked through that automaton all tokens at once;
* :mod:`.liveness` — which token states can still reach an accepting one;
* :mod:`.automaton` — ``TokenAutomaton``, the automaton over tokens, built on demand.
"""
