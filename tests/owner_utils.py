"""Ownership seen by infinity's owner check, for tests that cannot chown (not root)."""

import os

from infinity.checkpoint import owner


def foreign(monkeypatch, *paths) -> None:
    """Makes ``paths`` look owned by another uid to the owner check
    (``owner.owned_by_us``); the check itself is what is tested."""
    inodes = {os.stat(p, follow_symlinks=False).st_ino for p in paths}
    real = owner.owned_by_us
    monkeypatch.setattr(owner, "owned_by_us", lambda st: st.st_ino not in inodes and real(st))
