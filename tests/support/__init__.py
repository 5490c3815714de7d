"""Helpers of the test suite (not tests): importable as ``support.<module>`` (pytest puts ``tests/`` on the path)."""
