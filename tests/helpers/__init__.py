"""Helpers shared by the test packages: reference comparisons, tiny models, prompts, server processes, attention cases."""
