"""Loopline's benchmark suite (`make bench`); see bench/run.py and docs/performance.md."""
