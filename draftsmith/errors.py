"""What kind of failure an error is, so the orchestration knows whether to retry it.

Two kinds, each a plain base class that the engine's error classes mix in beside what they
subclass today (ValueError, RuntimeError, FileNotFoundError), so `except ValueError` elsewhere
keeps working:

- InputError: the input or the configuration is wrong (a bad record, a bad value, a missing
  file, refused layer ids, an unloadable checkpoint, a disk too small for the output). Every
  attempt fails the same way, so it is not retried; the message names the file, record or key
  and the fix.
- TransientError: something outside the input failed and may not fail again (an endpoint, the
  network, a crashed child process, a GPU still held by another job). Worth retrying.

An error of neither kind is a bug or something unforeseen; `worth_retrying` treats it as
transient, as the orchestration did before these classes existed.
"""

from __future__ import annotations


class InputError(Exception):
    """Bad input or configuration: fails the same way on every attempt. Fix it and rerun."""


class TransientError(Exception):
    """An endpoint, network or child-process fault: another attempt may succeed."""


class ConfigValueError(InputError, ValueError):
    """A setting whose value cannot work for this target or data (e.g. aux layer ids outside
    the target's layers); the message names the key."""


class MissingFileError(InputError, FileNotFoundError):
    """A file the run reads is not there; the message names the setting that points to it."""


class CheckpointError(InputError, ValueError):
    """A drafter, target or store file that cannot be read (truncated, garbled, missing a
    key); the message names the file, what is wrong and what to do."""


class WorkerCrashError(TransientError, RuntimeError):
    """A child process (a torchrun rank, an extraction worker) died or failed for a reason
    that is not an input error."""


def is_input_error(err: BaseException) -> bool:
    return isinstance(err, InputError)


def worth_retrying(err: BaseException) -> bool:
    """False for input and configuration errors, True for everything else."""
    return not isinstance(err, InputError)
