"""Errors a user can act on.

Every :class:`PdeformerError` is reported as one line (no traceback) and ends the
program with its ``exit_status``; under MPI the whole job ends. They are raised on
every rank at once (configuration checks are deterministic, files are read on rank 0
and the outcome broadcast, numerical checks are all-reduced), so no rank is left
waiting in a collective call.
"""


class PdeformerError(Exception):
    """A failure caused by the input or the run, not by a bug."""

    exit_status = 2


class ConfigError(PdeformerError):
    """Bad configuration: the message starts with the offending key."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)

    def __reduce__(self):  # picklable, so rank 0 can broadcast it
        return (type(self), (self.key, self.message))


class InputError(PdeformerError):
    """Bad input file (mesh, parameter file, prompt data): the message names the file."""


class SolverBreakdown(PdeformerError):
    """NaN or overflow in the solution: the message names prompt, layer and t."""

    exit_status = 3


class OutputError(PdeformerError):
    """A file of the run could not be written (disk full, quota, permissions): the
    message names the file; partial files are removed."""

    exit_status = 3


def status_of(error: BaseException) -> str:
    """summary.json's status for a run that ``error`` ended."""
    if isinstance(error, SolverBreakdown):
        return "breakdown"
    if isinstance(error, OutputError):
        return "output_error"
    if isinstance(error, PdeformerError):
        return "bad_input"
    return "failed"


def reworded(error: PdeformerError, message: str) -> PdeformerError:
    """An error of ``error``'s kind (its exit status and summary status) saying ``message``."""
    kind = next(k for k in (SolverBreakdown, OutputError, InputError, PdeformerError) if isinstance(error, k))
    return kind(message)


def within(error: PdeformerError, what: str) -> PdeformerError:
    """``error`` with ``what: `` before its message: the pass it happened in (the teacher's
    target pass, a study's case or reference, a training step). A ConfigError, whose
    message starts with its key, is returned as it is."""
    if isinstance(error, ConfigError):
        return error
    return reworded(error, f"{what}: {error}")
