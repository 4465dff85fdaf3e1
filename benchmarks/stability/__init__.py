"""The stability study of issue 15 (benchmarks/stability_study.py runs it; docs/stability.md explains it)."""
