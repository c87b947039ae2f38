"""Every error meant for the user: one base class, one line of message.

`GRPOError` is what the command line turns into ``error: <message>`` (exit code 2) instead of a
traceback; each subclass says which part of the run the mistake is in. The standard bases
(ValueError, RuntimeError, TimeoutError) stay for callers that catch those.
"""
from __future__ import annotations


class GRPOError(Exception):
    """A problem that stops the run; str(error) is the one line shown to the user."""


class ConfigError(GRPOError, ValueError):
    """A config mistake: the line names the key and what is allowed."""


class SetupError(GRPOError, RuntimeError):
    """A run that cannot start or go on (launcher, checkpoint, model size, a reward failing every step, ...)."""


class DataError(GRPOError, ValueError):
    """A data problem (missing file, unknown column, a prompt that is not text or messages, ...)."""


class ModelError(GRPOError, ValueError):
    """A model path that cannot be loaded."""


class RewardSpecError(GRPOError, ValueError):
    """A reward ``fn`` that cannot be resolved, or arguments it does not take."""


class RewardCountError(RewardSpecError):
    """A reward that returned a different number of scores than completions: a bug to fix, never retried."""


class RewardTimeout(GRPOError, TimeoutError):
    """A reward call that overran ``reward.timeout_s`` (its worker was killed)."""


class PeerLostError(GRPOError, RuntimeError):
    """A collective that timed out (distributed.timeout_s) or lost its connection: another rank failed or hangs."""


class GRPOWarning(UserWarning):
    """Something to know that does not stop the run, shown by the commands as one ``[grpo] warning: <message>``
    line (`show_warnings_as_lines`), not as Python's ``<file>:<line>: UserWarning:`` naming a library's frame."""


def show_warnings_as_lines() -> None:
    import warnings

    default = warnings.formatwarning
    if getattr(default, "grpo", False):
        return

    def one_line(message, category, filename, lineno, line=None):
        if issubclass(category, GRPOWarning):
            return f"[grpo] warning: {message}\n"
        return default(message, category, filename, lineno, line)

    one_line.grpo = True
    warnings.formatwarning = one_line
