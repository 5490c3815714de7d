"""The PyTorch backend's matrix products: which kernel multiplies each product, the kernels of speculum's
own (C sources beside their Python side, compiled on this machine and cached), and the probe that a
product's rows do not depend on each other.

Why a package: the fused forward asks one thing of its products (rows in, rows out, each row alone), and
everything that answers it - kernel choice, the kernels, their build, their probe - lives here, below the
forward that calls them.

* ``products.py`` - :func:`build_product`: each product's kernel, probed once per kind and shape;
* ``probe.py`` - the row-independence probe every product passes before it is trusted;
* ``onednn.py`` - float32 and bfloat16 on oneDNN weights packed once (also ``prepack_linears`` for
  models that keep transformers' forward);
* ``gguf_groups.py`` + ``gguf_groups.c`` - float32 products read from GGUF weight groups (Q4_0 to Q8_0,
  Q4_K, Q5_K, Q6_K); ``gguf_records.py`` - those groups packed as the kernel's records;
* ``amx_tiles.py`` + ``amx_tiles.c`` - bfloat16 products on AMX tiles;
* ``bf16_dot.py`` + ``bf16_dot.c`` - bfloat16 products by AVX-512 BF16 dot products (no tiles needed);
* ``int8_weights.py`` - int8 weight-only products (the ``int8`` target);
* ``q8_groups.py`` + ``q8_groups.c`` - GGUF weight groups times rows quantised to 8 bits, integer dot products
  (the ``q8`` target);
* ``attention_rows.py`` + ``attention_rows.c`` - attention of every query row of a layer in one call, each row
  alone (the fused forward's attention where it builds);
* ``row_ops.py`` + ``row_ops.c`` - the row-wise work between a block's products (norms, residual adds, rotary
  rotation, the gate), one call each (:mod:`~speculum.models.hf.forward.glued`);
* ``build.py`` - compiling the C kernels for this CPU; ``cache.py`` - where the built kernels are kept.

Example:
    >>> from speculum.models.hf.kernels.products import build_product
    >>> product = build_product([torch.nn.Linear(8, 4, bias=False)])     # doctest: +SKIP
    >>> product(torch.randn(3, 8)).shape, product.rows_alone               # doctest: +SKIP
    (torch.Size([3, 4]), True)
"""
