"""Estimation: ranks beyond the exact index's frontier, estimated, with the model's exact scores.

One concept: where building the exact index down to an item would cost too many forwards, these modules
estimate the item's rank instead, beside a bracket, and say which answer they give. They build on the exact
index (grown within a forward budget, it still answers exactly what it certifies); every log-probability
they report is the model's own, only the rank coordinate is estimated.

* :mod:`.envelope` — ``AREnvelopeIndex``: very deep ranks of unconstrained continuations, from a sampled
  per-depth envelope (an approximate rank coordinate, exact scores);
* :mod:`.format_walk` — the steps a format's members can take after a prefix, with the model's rows;
* :mod:`.sampling` — ``sample_format``: members of a format drawn from a known law, with their laws;
* :mod:`.siblings` — a draw's last step counted over every token it could take (the Rao-Blackwell term);
* :mod:`.estimate` — ``rank_from_sample``: the importance-sampled rank and its 95% interval;
* :mod:`.exposure` — ``estimate_rank(s)``: rank and exposure, exact when cheap, else estimated or bracketed.
"""
