"""The sections of ``run_gpu.py``, one module each, and what they share.

* ``common``: the settings (model shapes, full and tiny sizes), the state the sections of a run
  share, its time budget and its results file;
* ``probes``: wrapping an object's method for a while, and catching synchronising CUDA calls;
* ``kernels``, ``random_model``, ``equivalence``, ``throughput``, ``decode``, ``roofline``,
  ``serve``, ``hf``: the sections;
* ``summary``: the table printed at the end of a run.

The measurements themselves come from :mod:`pagedllm_bench` (machine description, JSON output,
tables, timing and copy bandwidth, workloads, transformers' models and continuous batching) and the
test suite's helpers (``tests/helpers``: paged-attention batches, their reference and tolerances;
greedy comparisons). Importing this package puts the repository (``pagedllm`` from this checkout, no
installation needed), ``benchmarks`` (``pagedllm_bench``) and ``tests`` on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
if str(REPO_ROOT / "benchmarks") not in sys.path:
    sys.path.insert(1, str(REPO_ROOT / "benchmarks"))
if str(REPO_ROOT / "tests") not in sys.path:
    sys.path.append(str(REPO_ROOT / "tests"))
