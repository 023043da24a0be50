"""Composite tier and the ``mctier`` command line."""
