"""Every kernel of the engine, and what builds or launches it.

* ``csrc/``: the native CPU kernels in C (paged decode and prefill attention, the panel-layout linear
  product, fused RMSNorm / SiLU-and-mul / rotary, the sampler's row max and log-sum-exp, softmax rows,
  and all decoder layers of a decode step in one call).
* ``cpu/``: :mod:`~pagedllm.kernels.cpu.library` builds ``csrc/`` with the system C compiler and loads
  it; :mod:`~pagedllm.kernels.cpu.ops`, :mod:`~pagedllm.kernels.cpu.attention`,
  :mod:`~pagedllm.kernels.cpu.linear`, :mod:`~pagedllm.kernels.cpu.decode_layers` and
  :mod:`~pagedllm.kernels.cpu.quant` (products with GGUF-quantized weights on their own blocks) wrap
  its functions for torch tensors.
* ``triton/``: :mod:`~pagedllm.kernels.triton.launch` (compiled, interpreted and ahead-of-time
  launches), the KV write (:mod:`~pagedllm.kernels.triton.kv_write`), paged attention
  (:mod:`~pagedllm.kernels.triton.attention`), fused norms and activations
  (:mod:`~pagedllm.kernels.triton.elementwise`), the sampler's threshold search
  (:mod:`~pagedllm.kernels.triton.sampling`) and compiling for a GPU without one
  (:mod:`~pagedllm.kernels.triton.aot`).
* :mod:`~pagedllm.kernels.attention_metadata`: the batch layout every attention kernel reads.

Nothing here imports the rest of the package (except its shared vocabulary).
"""
