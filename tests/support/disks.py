"""Small real file systems for store fault tests: a tmpfs of a few MiB mounted for the test (root only: the test
is skipped where `mount` is refused), filled up with a file and freed again. Always unmounted afterwards.
Imports nothing of the proxy."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

CHUNK_BYTES = 64 * 1024


@contextlib.contextmanager
def small_tmpfs(size: str = "4m") -> Iterator[Path]:
    """A fresh tmpfs of `size` (mount's syntax) on a new directory; skips the test when it cannot be mounted."""
    directory = Path(tempfile.mkdtemp(prefix="proxy-tmpfs-"))
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)],
            capture_output=True,
            text=True,
            check=False,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
        try:
            yield directory
        finally:
            # Lazy: a file the proxy still holds open must not keep the mount (and the test run) hanging.
            subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)
    finally:
        with contextlib.suppress(OSError):
            directory.rmdir()


def fill(directory: Path) -> Path:
    """Write a file into `directory` until its file system has no room left; that file (delete it to free)."""
    filler = directory / "filler"
    block = b"\0" * CHUNK_BYTES
    with open(filler, "wb", buffering=0) as file:
        size = len(block)
        while size:
            try:
                file.write(block[:size])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                size //= 2  # the last bytes, down to one
        os.fsync(file.fileno())
    return filler


def free_bytes(directory: Path) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize
