"""The selection kernels of the top-k engine, one idea per module.

* :mod:`~functopk.sparse.kernels.base`: dtypes, magnitudes, ``nonzero_1d``, exact
  thresholds in narrower dtypes;
* :mod:`~functopk.sparse.kernels.static`: the static-shape exact kernel
  (``torch.topk`` or a radix select), compiles with ``fullgraph=True``;
* :mod:`~functopk.sparse.kernels.scan`: the candidate scan (coordinates above a
  threshold, without concatenating the leaves);
* :mod:`~functopk.sparse.kernels.native`: the same scan as a small C loop
  (``native.c``), compiled at first use (the ATen scan runs where it cannot be
  built);
* :mod:`~functopk.sparse.kernels.libcache`: where that loop is compiled and kept,
  a private cache folder whose files are checked before they are loaded;
* :mod:`~functopk.sparse.kernels.exact`: the eager exact kernel (sampled bracket,
  scan, exact selection among the candidates, bounded fallbacks);
* :mod:`~functopk.sparse.kernels.approx`: the systematic sample and the approximate
  thresholds;
* :mod:`~functopk.sparse.kernels.triton_select`: the exact kernel in Triton for CUDA
  tensors (where the leaves are read from, the launches), whose ``@triton.jit``
  kernels are in :mod:`~functopk.sparse.kernels.triton_kernels` (imported only
  when one runs).

They work on the list of a tree's leaves, each flattened to 1-d in flat order
(see :mod:`functopk.tree`), and never change them. Which one runs is decided in
one place, :func:`functopk.sparse.dispatch.select`. Ranking rules shared by every
exact kernel: magnitudes ``|x|`` are compared in the common (promoted) dtype of
the leaves, NaN counts as ``+inf``, and among equal magnitudes the lower flat
index wins.
"""
