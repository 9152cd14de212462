"""The rehearsal's stand-in for nox (__main__.py)."""
