"""A disk that fills up while a stage writes: one clear error, and nothing half-written kept.

The stage preflights (draftsmith/preflight.py, draftsmith/extract/preflight.py) refuse to start
on a disk too small for a stage's estimate; a disk that another process fills afterwards shows
up here, at the write. Every writer of the run root (the generate journal, shards and their
receipts, checkpoints, exports, manifests) writes through `writing`, which turns the failure
into a `DiskFullError` naming the file, the bytes the write needed, what is free, and the fix.

A full disk shows up in three spellings, all handled: OSError ENOSPC or EDQUOT from Python's
own writes, a message from a native writer (safetensors: "No space left on device (os error
28)"), and torch.save's "PytorchStreamWriter failed writing file" or "unexpected pos", which
names no cause at all: there, the free space left on the filesystem at the moment of the
failure decides.

A DiskFullError is an input error: no retry finds more room, so the task fails at once with its
message. What the writers guarantee (tested on a real small tmpfs, tests/test_disk_full.py):
no partial file remains under a name a later run reads as finished, and a rerun once space is
freed resumes from the last complete unit (answer, shard, checkpoint) to the same outputs.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from draftsmith.errors import InputError

# Below this much free space, a write that failed for a reason it does not name failed because
# the disk is full (torch.save says only "file write failed" or "unexpected pos").
NEARLY_FULL_BYTES = 1 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_WORDS = ("no space left on device", "disk quota exceeded", "os error 28",
               "os error 122")


class DiskFullError(InputError, OSError):
    """A write ran out of disk space; the message names the file, the bytes and the fix.

    An OSError too (errno ENOSPC), so `except OSError` around a write still catches it."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.errno = errno.ENOSPC
        self.filename = path

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):
        return (type(self), (str(self), self.filename))


def free_bytes(destination: str | Path) -> int:
    """Free space on the filesystem that will hold `destination` (which may not exist yet)."""
    path = Path(destination).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def size_text(n: int) -> str:
    """Bytes as a person reads them, with the exact count: `1.50 GiB (1610612736 bytes)`."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def names_a_full_disk(err: BaseException) -> bool:
    """Whether the error, or one it was raised from, says the disk is full."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DiskFullError):
            return True
        if isinstance(current, OSError) and current.errno in _FULL_ERRNOS:
            return True
        if any(word in str(current).lower() for word in _FULL_WORDS):
            return True
        current = current.__cause__ or current.__context__
    return False


def is_disk_full(err: BaseException, path: str | Path, still_needed: int = 0) -> bool:
    """Whether a write into `path` failed with `err` because its disk is full: the error says
    so, or it is a native writer's unnamed failure while (almost) nothing is free there."""
    if names_a_full_disk(err):
        return True
    if not isinstance(err, (OSError, RuntimeError)):
        return False
    try:
        return free_bytes(path) < max(still_needed, NEARLY_FULL_BYTES)
    except OSError:
        return False


def disk_full_error(path: str | Path, needed: int | None, written: int = 0,
                    what: str = "") -> DiskFullError:
    """The error for a write into `path` that needed `needed` bytes (None: unknown) and had
    written `written` of them when the disk filled up."""
    path = Path(path)
    try:
        free = free_bytes(path)
        usage = shutil.disk_usage(_existing(path))
        room = (f"{size_text(free)} free of {size_text(usage.total)} on the filesystem "
                f"holding {_existing(path)}")
    except OSError:
        room = "the free space could not be read"
    if needed:
        wanted = f"it needed {size_text(needed)}"
        if written:
            wanted += f" and had written {size_text(written)} when the disk filled up"
    else:
        wanted = "it needed more room than is left"
    return DiskFullError(
        f"disk full: writing {what + ' ' if what else ''}{path} failed with "
        f"[Errno {errno.ENOSPC}] No space left on device: {wanted}; {room}. Nothing "
        "half-written is kept under a finished name. Free space there (or point run_root at "
        "a bigger disk) and run again: finished work is kept, and the stage resumes from its "
        "last complete answer, shard or checkpoint", str(path))


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@contextmanager
def writing(path: str | Path, needed: int | None = None, partial: str | Path | None = None,
            what: str = "") -> Iterator[None]:
    """Around a write of `path` (`needed` bytes, when known): a failure because the disk is
    full becomes a DiskFullError naming them. `partial`: the temp file the write goes to, whose
    size tells how far it got (measured before its caller removes it)."""
    try:
        yield
    except DiskFullError:
        raise
    except BaseException as err:
        written = _size(Path(partial)) if partial is not None else 0
        still_needed = max(0, (needed or 0) - written)
        if is_disk_full(err, path, still_needed):
            raise disk_full_error(path, needed, written, what) from err
        raise


@contextmanager
def writing_into(directory: str | Path, what: str = "") -> Iterator[None]:
    """Around a stage's writes into `directory` that name no file of their own (small reports,
    charts, logs): a disk-full failure becomes a DiskFullError naming the directory."""
    try:
        yield
    except DiskFullError:
        raise
    except BaseException as err:
        if names_a_full_disk(err):
            raise disk_full_error(getattr(err, "filename", None) or directory, None,
                                  what=what) from err
        raise


def append_line(path: Path, line: str) -> None:
    """Append one line to a journal and fsync it. A write cut short by a full disk is taken
    back (the file is cut to its length before it), so no torn line is left behind, and the
    error names the journal. Unbuffered: no bytes that failed to go out wait in a buffer to be
    written after the cut."""
    data = memoryview(line.encode("utf-8"))
    with writing(path, len(data), what="the journal"):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            before = os.fstat(fd).st_size
            try:
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            except BaseException:
                with suppress(OSError):
                    os.ftruncate(fd, before)
                raise
        finally:
            os.close(fd)
