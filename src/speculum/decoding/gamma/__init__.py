"""γ, the number of tokens drafted a step: the policy, the machine's costs it weighs, what it learns of a draft.

One concept: how long a block to draft next. Nothing here decides what is returned (that is the
verification rule's, :mod:`speculum.decoding.verify`); a worse γ costs time, never exactness.

* :mod:`.controller` — ``GammaPolicy`` / ``GammaController`` (``gamma="auto"``): the expected tokens a
  second of each block size, from the acceptance seen in each situation;
* :mod:`.costs` — ``CostModel``: what a verification block of each size costs on this machine, measured
  while decoding;
* :mod:`.profile` — ``DraftProfile``: what a generation learned about a draft model, kept for the next.
"""
