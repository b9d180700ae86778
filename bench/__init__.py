"""Benchmarks of the selection kernels and the data pipeline, as scripts and a pytest suite."""
