"""Logging on MPI ranks: rank 0 logs to stderr (and a log file), the other ranks only
their warnings, prefixed with their rank."""

from __future__ import annotations

import logging
import sys


log = logging.getLogger("pdeformer")


class _RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.prefix = f"[rank {rank}] " if rank else ""

    def filter(self, record):
        record.rankprefix = self.prefix
        return True


def setup_logging(comm, level=logging.INFO) -> None:
    """Rank 0 logs at ``level`` to stderr; other ranks only warnings, prefixed.

    The root logger gets a warnings-only handler first, so that libraries calling
    ``logging.basicConfig`` (FFCx) do not print their JIT compiler chatter."""
    if not logging.root.handlers:
        logging.root.addHandler(logging.StreamHandler(sys.stderr))
    for h in logging.root.handlers:
        h.setLevel(max(h.level, logging.WARNING))
    for h in list(log.handlers):
        if getattr(h, "_pdeformer", False):
            log.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._pdeformer = True
    handler.addFilter(_RankFilter(comm.rank))
    handler.setFormatter(logging.Formatter("%(rankprefix)s%(message)s"))
    log.addHandler(handler)
    log.setLevel(level if comm.rank == 0 else logging.WARNING)
    log.propagate = False


class _LogFile(logging.FileHandler):
    """A log file that, when it cannot be written (disk full), says so in one line on
    stderr and stops, instead of printing a traceback per record."""

    def handleError(self, record):
        if not getattr(self, "_failed", False):
            self._failed = True
            sys.stderr.write(f"warning: cannot write {self.baseFilename}: the log goes on "
                             "on stderr only\n")
        self.emit = lambda record: None


def add_log_file(comm, filename: str) -> logging.Handler | None:
    """Also log (rank 0) into ``filename``, with time stamps."""
    if comm.rank != 0:
        return None
    try:
        handler = _LogFile(filename, mode="w")
    except OSError as e:
        sys.stderr.write(f"warning: cannot write {filename} ({e.strerror}): the log goes on stderr only\n")
        return None
    handler._pdeformer = True
    handler.addFilter(_RankFilter(0))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    return handler


def remove_log_file(handler: logging.Handler | None) -> None:
    if handler is not None:
        log.removeHandler(handler)
        handler.close()
