"""Reproducible benchmarks: ``python -m benchmarks.save`` and ``python -m benchmarks.recovery``.

Benchmarks are scripts that print ratios and write JSON; they are never timed
assertions in the test suite. See ``docs/benchmarks.md``.
"""
