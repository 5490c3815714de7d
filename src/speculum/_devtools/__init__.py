"""Tools for developing speculum itself (not part of the public API)."""
