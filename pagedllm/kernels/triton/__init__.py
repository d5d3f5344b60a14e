"""Triton kernels; importing a module here needs the ``triton`` package, not a GPU."""
