"""Native CPU kernels (``pagedllm/kernels/csrc``) and their torch wrappers."""
