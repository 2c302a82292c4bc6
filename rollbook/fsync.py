"""Small durability helpers shared by the write-ahead log, the rollout spool and checkpoints."""

from __future__ import annotations

import os
import pathlib


def fsync_dir(path: pathlib.Path) -> None:
    """fsync a directory, so that files created, renamed or deleted in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
