"""The output folder of a run: one run at a time, no files of an earlier run left
looking like this one's, and nothing lost.

:class:`OutputFolder` (rank 0) creates the folder, takes its lock and moves the files an
earlier run wrote there into ``previous/`` (replacing what an even earlier run left
there); the log says what it moved. ``train --restart`` keeps the files of the training
it continues (checkpoint, history, params, heads). What a run may not touch:

* the files it reads: a run whose input (``model.params``, a prompt file, ...) lies in
  ``previous/`` or among the files it would move is refused before anything moves;
* a folder another run holds: its lock, and the lock of its ``previous/``; a
  ``previous/`` of a run's folder is not an output folder itself;
* anything, when it is refused: a run that ends with bad input (exit status 2) puts
  the folder back as it was (:meth:`OutputFolder.close` with ``restore``).

The lock, ``.pdeformer.lock``, holds the owner's pid, host, command and start time; the
owner touches it every HEARTBEAT seconds. A lock is stale, and taken over with a
warning, when it has not been touched for STALE_AFTER seconds (any host: a job killed by
the batch system, or a pid reused since) or, on this host, its process is gone.
Otherwise the second run stops with bad input (exit 2) naming the owner. Locks are read
non-blocking and size-checked (pdeformer.tools.files); one that is not a file, or names
no possible pid, is not taken for pdeformer's.
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

PICTURE_FORMATS = ("png", "svg")   # the pictures' formats ([output] plot_format, plot --format)

log = logging.getLogger("pdeformer")

LOCK = ".pdeformer.lock"
PREVIOUS = "previous"
HEARTBEAT = 60.0      # s between touches of the lock
STALE_AFTER = 900.0   # s without a touch: the owner is gone

# what pdeformer writes into an output folder (moved aside when a new run starts)
RUN_FILES = ("summary.json", "pdeformer.log", "diagnostics.csv", "gradient.npz", "history.csv",
             "checkpoint.npz", "params_*.npz", "heads_*.vtu", "heads.pvd", "ntk.json", "ntk.png",
             "gram.json", "gram.npz", "gram.png",
             "convergence.csv", "convergence.md", "convergence.png", "ensemble.csv",
             "budget.md", "budget.json", "budget.csv", "budget.png", ".*.tmp", "*.tmp",
             "fields.npz", "paraview.py",
             *(f"{picture}.{ext}" for picture in ("densities", "diagnostics", "training", "heads", "gradient")
               for ext in PICTURE_FORMATS),
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


PID_MAX = 1 << 22   # the largest pid Linux gives (pid_max's ceiling)


def _lock_owner(info) -> dict | None:
    """The owner a lock's JSON names ({pid, host, command, started}), or None where it
    is not what pdeformer writes (a pid that no process can have, fields missing)."""
    if not isinstance(info, dict):
        return None
    pid = info.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= PID_MAX:
        return None
    if not all(isinstance(info.get(k), str) and 0 < len(info[k]) <= 256 for k in ("host", "command", "started")):
        return None
    return info


def lock_holder(lock: str, key: str = "output.dir") -> tuple[str | None, str | None]:
    """(who holds ``lock``, None) while a run holds it; (None, why it is stale) for a
    stale lock, which is removed; (None, None) where there is none. A lock is stale when
    it has not been touched for STALE_AFTER seconds (its owner touches it every
    HEARTBEAT: a run the batch system killed, or a pid reused since) or, on this host,
    its process is gone. A lock that is not a file is bad input (InputError)."""
    from .files import read_text
    try:
        info = os.stat(lock)
    except FileNotFoundError:
        return None, None
    age, identity = time.time() - info.st_mtime, _identity(info)
    try:
        text = read_text(lock, key, max_bytes=64 * 1024)
    except InputError as e:
        if not os.path.exists(lock):
            return None, None
        if os.path.isfile(lock):    # unreadable: judged by its age alone
            text = ""
        else:
            raise InputError(f"{e}: it is not pdeformer's lock file; remove it if no run "
                             "uses this folder") from None
    try:
        owner = _lock_owner(json.loads(text))
    except ValueError:
        owner = None
    if owner is None:
        who = f"another run (its lock {lock} cannot be read as pdeformer's)"
        stale = age > STALE_AFTER
    else:
        who = (f"pdeformer {owner['command']} (pid {owner['pid']} on {owner['host']}, "
               f"since {owner['started']})")
        stale = age > STALE_AFTER or (owner["host"] == socket.gethostname() and not _alive(owner["pid"]))
    if not stale:
        return who, None
    why = who + (f", not touched for {age:.0f} s" if age > STALE_AFTER else ", process gone")
    _remove_stale(lock, identity)
    return None, why


def _identity(info: os.stat_result) -> tuple:
    """What tells one lock file from another taken since (an inode number may be reused;
    its modification time and size are the ones a rename keeps)."""
    return info.st_ino, info.st_mtime_ns, info.st_size


def _remove_stale(lock: str, identity: tuple) -> None:
    """Remove the stale lock judged (:func:`_identity`), not one another run has taken
    since: it is moved aside atomically and checked; a lock not the judged one is put back."""
    aside = f"{lock}.{os.getpid()}.stale"
    try:
        os.rename(lock, aside)
    except FileNotFoundError:      # another run removed it first
        return
    try:
        if _identity(os.stat(aside)) != identity:
            os.link(aside, lock)   # another run's fresh lock: back (unless a third took its place)
    except FileExistsError:
        pass
    finally:
        os.remove(aside)


class OutputFolder:
    """Lock and clean an output folder for one run (call :meth:`open` and
    :meth:`close` on rank 0 only). ``keep``: patterns of earlier files this run
    continues; ``reads``: [(key, path)] of the files the run reads (none of them may be
    moved or replaced by opening the folder).

    Opening moves the earlier run's files into ``previous/`` and sets the previous
    ``previous/`` aside; :meth:`close` drops that one, or, with ``restore`` (a run
    refused before it ran: exit status 2), puts everything back as it was: a refused
    command changes nothing in the folder."""

    def __init__(self, path: str, command: str, keep=(), reads=()):
        self.path = path
        self.command = command
        self.keep = tuple(keep)
        self.reads = list(reads)
        self.lock = os.path.join(path, LOCK)
        self._stop = threading.Event()
        self._beat = None
        self._locked = False
        self._set_aside = None   # the earlier previous/, until close
        self._created = False    # the folder did not exist before open
        self._cleared = False    # the earlier files are moved aside: the others are this run's
        self._made_previous = False
        self.moved: list[str] = []
        self.stale = None

    @property
    def previous(self) -> str:
        return os.path.join(self.path, PREVIOUS)

    def open(self) -> None:
        """Create the folder, take the lock, move earlier files aside; InputError if the
        folder cannot be written, another run holds it (or its previous/, or it is the
        previous/ of a run's folder), or the run reads a file that opening would move."""
        self._check_not_previous()
        try:
            self._created = not os.path.isdir(self.path)
            os.makedirs(self.path, exist_ok=True)
            self._take_lock()
        except OSError as e:
            raise InputError(f"output.dir: cannot write to {self.path} ({e.strerror})") from None
        self._locked = True
        try:
            self._check_reads()
            self._move_aside()
        except OSError as e:
            self.close(restore=True)
            raise InputError(f"output.dir: cannot move the earlier files of {self.path} "
                             f"aside ({e.strerror})") from None
        except BaseException:
            self.close(restore=True)
            raise
        self._beat = threading.Thread(target=self._heartbeat, name="pdeformer-lock", daemon=True)
        self._beat.start()

    def close(self, restore: bool = False) -> None:
        """Release the lock; drop the set-aside previous/ (``restore``: put the folder
        back as it was before :meth:`open`, removing what this run wrote there)."""
        self._stop.set()
        if not self._locked:
            return
        try:
            if restore:
                self._restore()
            elif self._set_aside is not None:
                shutil.rmtree(self._set_aside, ignore_errors=True)
        finally:
            self._set_aside = None
            self._release()
        if restore and self._created:    # a folder this run made, left empty
            try:
                os.rmdir(self.path)
            except OSError:
                pass

    def report(self) -> None:
        """Log what opening did (after the log file is open)."""
        if self.stale:
            log.warning("warning: output.dir: took over the stale lock of %s", self.stale)
        if self.moved:
            log.info("moved %d file(s) of an earlier run to %s/", len(self.moved), self.previous)

    # ------------------------------------------------------------------ what may not be touched
    def _check_not_previous(self) -> None:
        """The previous/ of a pdeformer output folder, and anything in it, is that folder's
        run's: the next run there replaces it."""
        here = os.path.realpath(self.path)
        while os.path.dirname(here) != here:
            parent = os.path.dirname(here)
            if os.path.basename(here) == PREVIOUS and any(
                    os.path.lexists(os.path.join(parent, n)) for n in (LOCK, "summary.json", "pdeformer.log")):
                where = "is" if here == os.path.realpath(self.path) else f"lies in {here},"
                raise InputError(f"output.dir: {self.path} {where} where the run in {parent} keeps the files "
                                 "of the run before it (the next run there replaces it): choose another folder")
            here = parent

    def _check_reads(self) -> None:
        """No file the run reads lies in previous/ (replaced) or among the files moved
        (links resolved: the file itself is what would move)."""
        folder, previous = os.path.realpath(self.path), os.path.realpath(self.previous)
        for key, name in self.reads:
            if name is None:
                continue
            real = os.path.realpath(name)
            if real == previous or real.startswith(previous + os.sep):
                raise InputError(f"{key}: {name} lies in {self.previous}/, which this run replaces "
                                 "with the files of the run before it: copy it elsewhere first, or "
                                 "choose another output.dir")
            if os.path.dirname(real) == folder and self._moves(os.path.basename(real)):
                raise InputError(f"{key}: {name} is a file of the earlier run in {self.path}, which "
                                 f"this run moves to {PREVIOUS}/: copy it elsewhere first, or choose "
                                 "another output.dir")

    def _moves(self, name: str) -> bool:
        return _matches(name, RUN_FILES) and not _matches(name, self.keep)

    # ------------------------------------------------------------------ the lock
    def _take_lock(self) -> None:
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                 "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        for _ in range(3):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                held, stale = lock_holder(self.lock)
                if held is not None:
                    raise InputError(f"output.dir: {self.path} is in use by {held}; wait for it or "
                                     f"choose another output.dir (if that run is dead, remove "
                                     f"{self.lock})") from None
                self.stale = stale or self.stale
                continue   # stale, removed: try again
            with os.fdopen(fd, "w") as f:
                json.dump(owner, f)
            return
        raise InputError(f"output.dir: cannot take the lock {self.lock} (other runs keep taking it)")

    def _release(self) -> None:
        self._locked = False
        try:
            with open(self.lock) as f:
                mine = json.load(f).get("pid") == os.getpid()
            if mine:
                os.remove(self.lock)
        except (OSError, ValueError, AttributeError):
            pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            try:
                os.utime(self.lock)
            except OSError:
                pass

    # ------------------------------------------------------------------ earlier files
    def _move_aside(self) -> None:
        names = sorted(n for n in os.listdir(self.path) if self._moves(n))
        if not names:
            self._cleared = True
            return
        if os.path.lexists(self.previous):
            for where, _, files in os.walk(self.previous):   # a run in previous/ or below it
                held, _ = lock_holder(os.path.join(where, LOCK)) if LOCK in files else (None, None)
                if held is not None:
                    raise InputError(f"output.dir: {where} is in use by {held}; this run would "
                                     f"replace {self.previous}: wait for that run or choose another "
                                     "output.dir")
            aside = os.path.join(self.path, f".{PREVIOUS}.{os.getpid()}.aside")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(self.previous, aside)
            self._set_aside = aside
        os.makedirs(self.previous)
        self._made_previous = True
        for n in names:
            os.replace(os.path.join(self.path, n), os.path.join(self.previous, n))
            self.moved.append(n)
        self._cleared = True

    def _restore(self) -> None:
        """Undo :meth:`_move_aside`: this run's files removed, the earlier ones and the
        earlier previous/ put back (what cannot be moved back stays in previous/, with a
        warning)."""
        try:
            for n in os.listdir(self.path) if self._cleared else ():   # what this run wrote
                if self._moves(n):
                    path = os.path.join(self.path, n)
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    else:
                        os.remove(path)
            if self._made_previous:             # previous/ is this run's: put it back
                for n in self.moved:
                    os.replace(os.path.join(self.previous, n), os.path.join(self.path, n))
                self.moved = []
                shutil.rmtree(self.previous)
            if self._set_aside is not None:
                os.replace(self._set_aside, self.previous)
        except OSError as e:
            log.warning("warning: output.dir: could not put %s back as it was (%s); the earlier run's "
                        "files are in %s", self.path, e.strerror, self.previous)
