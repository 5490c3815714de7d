"""The PyTorch backend's own forwards: transformers' math of the Llama family in one function, computed so that each row's
logits depend on its own sequence alone, and the ways the model feeds many sequences or prefixes through it.

Why a package: these modules compute logits (the model decides what to feed, the kernels multiply), and
they share one guarantee, ROW-CANONICAL rows: a row's logits are the same however its tokens were fed.

* ``fused.py`` - :class:`FusedForward`: the fused CPU forward of Llama-family models, checked at load
  against transformers' own;
* ``attention.py`` - causal attention in which each query row gets a shape its position alone fixes;
* ``packed.py`` - several sequences' tokens in one forward, each sequence's rows bitwise as alone;
* ``prefix_levels.py`` - the rows after many prefixes, walked one level (one token deeper) per forward.

Example:
    >>> from speculum.models.hf.forward.attention import keys_needed
    >>> keys_needed(5), keys_needed(70)
    (16, 128)
"""
