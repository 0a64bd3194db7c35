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


def _run_or_skip(command: list[str], what: str) -> None:
    """Run a system command the test needs; skip the test (root only, or a missing tool) when it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        pytest.skip(f"cannot {what} here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot {what} here: {done.stderr.strip() or done.returncode}")


@contextlib.contextmanager
def _unmounted_after(directory: Path) -> Iterator[None]:
    try:
        yield
    finally:
        # Lazy: a file the proxy still holds open must not keep the mount (and the test run) hanging.
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)


@contextlib.contextmanager
def small_tmpfs(size: str = "4m") -> Iterator[Path]:
    """A fresh tmpfs of `size` (mount's syntax) on a new directory; skips the test when it cannot be mounted."""
    directory = Path(tempfile.mkdtemp(prefix="proxy-tmpfs-"))
    try:
        _run_or_skip(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)], "mount a tmpfs")
        with _unmounted_after(directory):
            yield directory
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


@contextlib.contextmanager
def ext4_on_loop(size: str = "16M") -> Iterator[tuple[Path, Path, str]]:
    """A fresh ext4 file system in an image file, loop-mounted with `errors=remount-ro` (what a production
    volume does when its disk fails): (mount directory, image, loop device name). Skips where it cannot be
    mounted or its error trigger is missing."""
    workspace = Path(tempfile.mkdtemp(prefix="proxy-ext4-"))
    image, directory = workspace / "disk.img", workspace / "mnt"
    directory.mkdir()
    try:
        subprocess.run(["truncate", "-s", size, str(image)], check=True)
        _run_or_skip(["mkfs.ext4", "-q", "-F", str(image)], "make an ext4 file system")
        _run_or_skip(["mount", "-o", "loop,errors=remount-ro", str(image), str(directory)], "loop-mount ext4")
        with _unmounted_after(directory):
            source = subprocess.run(
                ["findmnt", "-n", "-o", "SOURCE", str(directory)], capture_output=True, text=True, check=True
            )
            device = Path(source.stdout.strip()).name
            if not Path(f"/sys/fs/ext4/{device}/trigger_fs_error").exists():
                pytest.skip("this kernel has no ext4 error trigger")
            yield directory, image, device
    finally:
        with contextlib.suppress(OSError):
            image.unlink()
        with contextlib.suppress(OSError):
            directory.rmdir()
        with contextlib.suppress(OSError):
            workspace.rmdir()


def fail_file_system(device: str) -> None:
    """Make the kernel record an ext4 error on `device`: with `errors=remount-ro` it turns the file system
    read-only at once (emergency read-only), open files included; writes then fail with EROFS."""
    Path(f"/sys/fs/ext4/{device}/trigger_fs_error").write_text("proxy fault test\n")


def remount_checked(directory: Path, image: Path) -> None:
    """Unmount, repair (`e2fsck -fy`, as an operator would) and mount the image again, writable."""
    subprocess.run(["umount", str(directory)], check=True)
    subprocess.run(["e2fsck", "-fy", str(image)], capture_output=True, check=False)  # 1: errors were corrected
    subprocess.run(["mount", "-o", "loop", str(image), str(directory)], check=True)
