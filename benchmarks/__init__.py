"""Benchmark scripts: each prints a table and writes JSON and Markdown under results/.

Run from the repository root: ``python -m benchmarks.bench_sd`` or ``saguaro bench sd``.
"""
