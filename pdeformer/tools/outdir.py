"""The output folder of a run: one run at a time, and no files of an earlier run left
looking like this one's.

:class:`OutputFolder` (rank 0) creates the folder, takes its lock and moves the files an
earlier run wrote there into ``previous/`` (replacing what an even earlier run left
there); the log says what it moved. ``train --restart`` keeps the files of the training
it continues (checkpoint, history, params, heads).

The lock, ``.pdeformer.lock``, holds the owner's pid, host, command and start time; the
owner touches it every HEARTBEAT seconds. A lock is stale, and taken over with a
warning, when its process is gone (same host) or it has not been touched for STALE_AFTER
seconds (any host: a job killed by the batch system). Otherwise the second run stops
with bad input (exit 2) naming the owner.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import logging
import os
import shutil
import socket
import threading
import time

from .errors import InputError

log = logging.getLogger("pdeformer")

LOCK = ".pdeformer.lock"
PREVIOUS = "previous"
HEARTBEAT = 60.0      # s between touches of the lock
STALE_AFTER = 900.0   # s without a touch: the owner is gone

# what pdeformer writes into an output folder (moved aside when a new run starts)
RUN_FILES = ("summary.json", "pdeformer.log", "diagnostics.csv", "gradient.npz", "history.csv",
             "checkpoint.npz", "params_*.npz", "heads_*.vtu", "heads.pvd", "ntk.json", "ntk.png",
             "gram.json", "gram.npz", "gram.png",
             "convergence.csv", "convergence.md", "convergence.png", ".*.tmp", "*.tmp",
             "fields.npz", "paraview.py",
             *(f"{picture}.{ext}" for picture in ("densities", "diagnostics", "training", "heads", "gradient")
               for ext in ("png", "svg")),
             *(f"{series}_*.{ext}" for series in ("density", "velocity", "tokens")
               for ext in ("pvd", "pvtu", "vtu", "bp")))
# what train --restart continues
TRAINING_STATE = ("checkpoint.npz", "history.csv", "params_*.npz", "heads_*.vtu", "heads.pvd")


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process
        return True
    return True


class OutputFolder:
    """Lock and clean an output folder for one run (call :meth:`open` and
    :meth:`close` on rank 0 only). ``keep``: patterns of earlier files this run
    continues."""

    def __init__(self, path: str, command: str, keep=()):
        self.path = path
        self.command = command
        self.keep = tuple(keep)
        self.lock = os.path.join(path, LOCK)
        self._stop = threading.Event()
        self._beat = None
        self.moved: list[str] = []
        self.stale = None

    def open(self) -> None:
        """Create the folder, take the lock, move earlier files aside; InputError
        (output.dir) if the folder cannot be written or another run holds it."""
        try:
            os.makedirs(self.path, exist_ok=True)
            self._take_lock()
        except OSError as e:
            raise InputError(f"output.dir: cannot write to {self.path} ({e.strerror})") from None
        try:
            self._move_aside()
        except OSError as e:
            self.close()
            raise InputError(f"output.dir: cannot move the earlier files of {self.path} "
                             f"aside ({e.strerror})") from None
        self._beat = threading.Thread(target=self._heartbeat, name="pdeformer-lock", daemon=True)
        self._beat.start()

    def close(self) -> None:
        self._stop.set()
        try:
            with open(self.lock) as f:
                mine = json.load(f).get("pid") == os.getpid()
            if mine:
                os.remove(self.lock)
        except (OSError, ValueError):
            pass

    def report(self) -> None:
        """Log what opening did (after the log file is open)."""
        if self.stale:
            log.warning("warning: output.dir: took over the stale lock of %s", self.stale)
        if self.moved:
            log.info("moved %d file(s) of an earlier run to %s/", len(self.moved),
                     os.path.join(self.path, PREVIOUS))

    # ------------------------------------------------------------------ the lock
    def _take_lock(self) -> None:
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                 "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        for _ in range(3):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                held = self._holder()
                if held is not None:
                    raise InputError(f"output.dir: {self.path} is in use by {held}; wait for it or "
                                     f"choose another output.dir (if that run is dead, remove "
                                     f"{self.lock})")
                continue   # stale, removed: try again
            with os.fdopen(fd, "w") as f:
                json.dump(owner, f)
            return
        raise InputError(f"output.dir: cannot take the lock {self.lock} (other runs keep taking it)")

    def _holder(self) -> str | None:
        """Who holds the lock (a description), or None after removing a stale lock."""
        try:
            with open(self.lock) as f:
                info = json.load(f)
            age = time.time() - os.stat(self.lock).st_mtime
            who = (f"pdeformer {info['command']} (pid {int(info['pid'])} on {info['host']}, "
                   f"since {info['started']})")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            info, who, age = None, "an unreadable lock", time.time() - os.stat(self.lock).st_mtime
        if info is not None and info["host"] == socket.gethostname():
            stale = not _alive(int(info["pid"]))
        else:
            stale = age > STALE_AFTER
        if not stale:
            return who
        self.stale = who + (f", not touched for {age:.0f} s" if age > STALE_AFTER else ", process gone")
        try:
            os.remove(self.lock)
        except FileNotFoundError:
            pass
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            try:
                os.utime(self.lock)
            except OSError:
                pass

    # ------------------------------------------------------------------ earlier files
    def _move_aside(self) -> None:
        names = sorted(n for n in os.listdir(self.path)
                       if _matches(n, RUN_FILES) and not _matches(n, self.keep))
        if not names:
            return
        previous = os.path.join(self.path, PREVIOUS)
        shutil.rmtree(previous, ignore_errors=True)
        os.makedirs(previous)
        for n in names:
            os.replace(os.path.join(self.path, n), os.path.join(previous, n))
        self.moved = names
