"""Benchmarks: prompt suites, side-by-side runs, exactness checks and reports."""
