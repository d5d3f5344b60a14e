"""Benchmarks: offline throughput (with Hugging Face baselines), online serving, and a roofline.

``pagedllm bench throughput|serve|roofline``; see ``docs/PERFORMANCE.md`` for the figures and the
commands that produced them.
"""
