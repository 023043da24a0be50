"""Benchmarks (not tests): `make bench` runs bench/suite.py."""
