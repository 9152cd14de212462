"""The rehearsal's stand-in for pip (__main__.py)."""
