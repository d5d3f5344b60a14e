"""Running one model across processes, devices and machines: tensor and pipeline parallelism.

- :mod:`~pagedllm.distributed.placement`: which rank holds what (heads, columns, vocabulary rows,
  layers), the checks made before any process starts, and the checkpoint selection of a rank.
- :mod:`~pagedllm.distributed.groups`: the torch.distributed process groups and collectives.
- :mod:`~pagedllm.distributed.layers`: the tensor-parallel forms of a loaded model's layers.
- :mod:`~pagedllm.distributed.step_channel`: a step's inputs sent from the driver to every rank as
  tensors.
"""
