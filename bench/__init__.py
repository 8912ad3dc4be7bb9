"""Benchmarks for weightserver (not tests): `python bench/run.py --help`."""
