"""Benchmarks of the proxy against a lean legacy upstream, each figure measured beside its baseline."""
