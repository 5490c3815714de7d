"""The exact index: a model's continuations of a prompt in exact descending probability, built on demand.

One concept, one data structure: a prefix tree of the live prefixes within a log-prob budget, deepened in
place as queries need it, with its complete sequences counted by bucket so a query sorts only one band.
Everything here answers exactly (ties broken by token ids): what estimates beyond the built frontier lives
in :mod:`speculum.enumeration.estimation`, and the front class ``AutoregressiveEnumerable``
(:mod:`speculum.enumeration.enumerable`) wraps this index. Of enumeration, it imports only the formats.

* :mod:`.support` — ``Support``: which continuations an index enumerates (length, ``eos``, a format);
* :mod:`.tree` — the live prefix tree, built level by level with batched forwards;
* :mod:`.histogram` — the count histogram over quantised information, the coarse level of the index;
* :mod:`.beam` — a small beam that aims the first budget of a query;
* :mod:`.seek_index` — ``SeekIndex``: tree, histogram and beam as one persistent exact index;
* :mod:`.stream` — the index's items as a stream in bounded memory;
* :mod:`.strings` — ``StringIndex``: the strings of a format, each scored over all its tokenizations;
* :mod:`.protocols` — ``EnumerationIndex`` / ``ScoringIndex``: what every index offers.
"""
