"""Benchmark: question suites, runners and reports."""
