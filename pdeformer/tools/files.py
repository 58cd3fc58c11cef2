"""Reading the files a user names: never blocking, never unbounded, checked before use.

Every file pdeformer reads on the user's word -- config and study files, parameter files
and checkpoints, prompt and target files and data folders, locks, the pinned costs --
is opened here:

* non-blocking and as a regular file: a FIFO, a device (``/dev/zero``) or a folder
  named by mistake is refused at once instead of waited on or read without end;
* size-checked before anything is read: small records (locks, JSON, TOML) against a
  fixed limit, arrays against the memory they unpack to (an ``.npz`` member's size
  is read from the zip directory, so a small file that unpacks to terabytes is refused
  before it is unpacked);
* with every failure, whatever raised it, as one :class:`InputError` line naming
  ``what`` (the config key, option or variable the path came from) and the file.

What the content must be (arrays, shapes, keys) is then checked by the reader.
"""

from __future__ import annotations

import io
import os
import stat
import zipfile

import numpy as np

from .errors import InputError

KB, MB = 2**10, 2**20
SMALL_RECORD = 1 * MB      # locks, costs, checkpoint metadata: a few kB in practice
TEXT_FILE = 256 * MB       # config and study files (a config may list 10^6 prompts)
XDMF_BYTES = 64 * MB       # an XDMF mesh file is a header (its data is in the .h5 file)


class FileError(InputError):
    """A user's file that cannot be used: ``what`` (the key it came from), the path and
    the reason, as one line."""

    def __init__(self, what: str, path: str, reason: str):
        self.what, self.path, self.reason = what, path, reason
        super().__init__(f"{what}: {path}: {reason}" if what else f"{path}: {reason}")

    def __reduce__(self):   # picklable, so rank 0 can broadcast it
        return (type(self), (self.what, self.path, self.reason))


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _size(n: float) -> str:
    return f"{n / MB:.3g} MB" if n < 2**30 else f"{n / 2**30:.3g} GB"


def open_regular(path: str, what: str, max_bytes: float | None = None) -> io.BufferedReader:
    """``path`` opened for binary reading: a regular file of at most ``max_bytes``
    (InputError naming ``what`` and the file otherwise). Opening never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileError(what, path, "no such file") from None
    except OSError as e:
        raise FileError(what, path, f"cannot open it ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileError(what, path, f"is {_kind(info.st_mode)}, not a file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise FileError(what, path, f"{_size(info.st_size)} is more than such a file "
                            f"holds (at most {_size(max_bytes)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str, what: str, max_bytes: float = SMALL_RECORD) -> bytes:
    """The whole of a regular file of at most ``max_bytes`` (see :func:`open_regular`)."""
    with open_regular(path, what, max_bytes) as f:
        try:
            data = f.read(int(max_bytes) + 1)
        except OSError as e:
            raise FileError(what, path, f"cannot read it ({e.strerror})") from None
    if len(data) > max_bytes:     # it grew while read
        raise FileError(what, path, f"more than such a file holds (at most {_size(max_bytes)})")
    return data


def read_text(path: str, what: str, max_bytes: float = SMALL_RECORD) -> str:
    """The text (UTF-8) of a regular file of at most ``max_bytes``."""
    try:
        return read_bytes(path, what, max_bytes).decode("utf-8")
    except UnicodeDecodeError:
        raise FileError(what, path, "not a text file") from None


def array_budget() -> float:
    """The most bytes an array file may unpack to: the node's available memory (its
    MemAvailable; 64 GB where that is unknown)."""
    from .machine import available_memory
    return available_memory() or 64.0 * 2**30


def _zip_directory(f, what: str, path: str) -> dict:
    """{member name: unpacked bytes} of the open ``.npz`` file ``f`` (its zip directory
    alone is read); FileError for an empty file or one that is not a zip."""
    if os.fstat(f.fileno()).st_size == 0:
        raise FileError(what, path, "an empty file (0 bytes), not an .npz")
    try:
        with zipfile.ZipFile(f) as z:
            return {i.filename: i.file_size for i in z.infolist()}
    except Exception as e:   # a damaged file fails in zipfile in many ways
        raise FileError(what, path, f"not a readable .npz file ({type(e).__name__}: {e})") from None


def load_npz(path: str, what: str, names: tuple | None = None, max_bytes: float | None = None) -> dict:
    """{name: array} of an ``.npz`` file (``names``: only these, where present),
    without pickles; refused with one line (naming ``what`` and the file) where it is
    not a regular file, not a readable zip of ``.npy`` arrays, or its arrays unpack to
    more than ``max_bytes`` (default :func:`array_budget`)."""
    budget = array_budget() if max_bytes is None else max_bytes
    with open_regular(path, what) as f:
        members = _zip_directory(f, what, path)
        total = sum(size for n, size in members.items() if names is None or n.removesuffix(".npy") in names)
        if total > budget:
            raise FileError(what, path, f"its arrays unpack to {_size(total)}, more than "
                            f"the {_size(budget)} of memory available")
        try:
            f.seek(0)
            with np.load(f, allow_pickle=False) as npz:
                return {k: np.asarray(npz[k]) for k in npz.files if names is None or k in names}
        except Exception as e:   # a damaged file fails in zlib, numpy, ... in many ways
            raise FileError(what, path, f"not a readable .npz file ({type(e).__name__}: {e})") from None


def npz_names(path: str, what: str) -> list[str]:
    """The array names of an ``.npz`` file (read from its zip directory only)."""
    with open_regular(path, what) as f:
        return [n.removesuffix(".npy") for n in _zip_directory(f, what, path)]
