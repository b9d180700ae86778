"""The error convention of every command of the project: a user's mistake is one line on
stderr naming the thing and the fix, exit code 2, no traceback (``--debug`` shows it); a real
bug still raises. Ctrl-C (SIGINT) or SIGTERM is one line too, "interrupted; <what was kept and
how to continue>", exit 130 (SIGINT) or 143 (SIGTERM): the signal unwinds the command like an
exception, so every ``finally`` and atomic write cleans up on the way.

    class MyError(UserError): ...            # or raise UserError("--out X: ...; use ...")

    @command
    def main(argv=None) -> int: ...

    @command(kept="no results were written; run the same command again")
    def main(argv=None) -> int: ...

Lives in data_dali, the bottom layer, so that ``python -m data_dali.prepare`` and the commands
built on cmacc (train.py, cmacc.apps.*) share it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import tempfile
from pathlib import Path

from .fileio import DISK_ERRNOS  # noqa: F401 - (where commands found it first)
from .fileio import LOCK_NAME

USER_ERROR_EXIT = 2
INTERRUPT_EXIT = 128  # + the signal's number: 130 for SIGINT (Ctrl-C), 143 for SIGTERM
KEPT = ("every finished output is kept (files are written whole or not at all); run the same "
        "command again to continue")
DEBUG_HELP = "show the full traceback of an error (errors are one line otherwise)"


class UserError(Exception):
    """A mistake in what the user asked for (flags, files, data): the message says which and
    what to do. Commands print it as one line and exit 2."""


class Interrupted(Exception):
    """A command, or a run inside one, stopped by a signal after keeping what it could: the
    message says what was kept and how to continue. Exit code ``INTERRUPT_EXIT + signum``."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.signum = int(signum)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, as Ctrl-C raises KeyboardInterrupt."""


def _raise_terminated(signum, frame):
    raise Terminated()


def first_line(e: BaseException, limit: int | None = None) -> str:
    """An exception's message as one line (its first), or its type's name if it has none."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def say_line(line: str) -> None:
    """One line on stderr in one write: print() writes the text and its newline apart (stderr
    is written through), so the lines of two ranks sharing torchrun's stderr could interleave
    into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def say_error(e: BaseException) -> None:
    """A command's error as its one line on stderr, ``error: <message>``, said once (the ranks
    of a run that ends on an agreed error say it before any of them exits: cmacc.trainer)."""
    if not getattr(e, "said", False):
        say_line(f"error: {e}")
        e.said = True


def wants_debug(argv) -> bool:
    return "--debug" in (sys.argv[1:] if argv is None else argv)


def strip_debug(argv):
    """argv without --debug (commands accept it anywhere)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return [a for a in args if a != "--debug"]


def command(main=None, *, kept: str = KEPT):
    """Wrap a command's ``main(argv)``: UserError → ``error: <message>`` on stderr, exit 2;
    Ctrl-C / SIGTERM (or an ``Interrupted`` from a run inside) → ``interrupted; <kept>``, exit
    128 + the signal; ``--debug`` anywhere in argv keeps the traceback. ``main`` receives argv
    without --debug. A command that fails leaves no empty folder behind that its
    ``output_folder`` created (one holding only the lock file of its refused run is empty)."""
    if main is None:
        return functools.partial(command, kept=kept)

    @functools.wraps(main)
    def run(argv=None):
        debug = wants_debug(argv)
        mark = len(_CREATED)
        try:
            with _sigterm_raises():
                code = main(strip_debug(argv))
                sys.stdout.flush()  # a reader that left fails here, not at interpreter exit
                return code
        except BaseException as e:
            _remove_empty_created(mark)
            if debug:
                raise
            if isinstance(e, BrokenPipeError):  # `... | head` stopped reading: end quietly,
                _stdout_to_devnull()            # as a SIGPIPE would (exit 141)
                raise SystemExit(INTERRUPT_EXIT + signal.SIGPIPE) from None
            if isinstance(e, UserError):
                say_error(e)
                raise SystemExit(USER_ERROR_EXIT) from None
            if isinstance(e, (Interrupted, KeyboardInterrupt)):
                signum = getattr(e, "signum", signal.SIGTERM if isinstance(e, Terminated) else
                                 signal.SIGINT)
                say_line(f"interrupted; {e if isinstance(e, Interrupted) else kept}")
                raise SystemExit(INTERRUPT_EXIT + signum) from None
            raise
        finally:
            del _CREATED[mark:]

    return run


def _stdout_to_devnull() -> None:
    """Point the process's stdout at /dev/null, so that the interpreter's last flush of a pipe
    nobody reads does not print "Exception ignored ... BrokenPipeError"."""
    if sys.stdout is not sys.__stdout__:  # (a caller's stand-in, e.g. a test's capture)
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


# folders output_folder created (outermost first): a failed command removes those still empty
_CREATED: list[Path] = []


def _remove_empty_created(mark: int) -> None:
    for folder in reversed(_CREATED[mark:]):
        try:
            if [p.name for p in folder.iterdir()] == [LOCK_NAME]:  # its run's lock (let go by now)
                (folder / LOCK_NAME).unlink()
            folder.rmdir()  # only if empty: whatever a command finished stays
        except OSError:
            pass


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises ``Terminated`` in the main thread while a command runs (Python's default
    would end the process at once, skipping every clean-up)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def ignore_interrupts() -> None:
    """For worker processes (a ``Pool`` initializer): the parent handles Ctrl-C, and ends them;
    a worker's own KeyboardInterrupt would only print a traceback per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def prog_name(module: str, installed: str) -> str:
    """What ``--help`` calls a command: its installed name when run as that (``cmacc-prepare``),
    else ``python -m <module>``."""
    return installed if Path(sys.argv[0]).name == installed else f"python -m {module}"


class ArgumentParser(argparse.ArgumentParser):
    """argparse for a ``@command``: a bad flag or value is a UserError (one line, exit 2)
    rather than the usage block; ``--debug`` is listed in ``--help``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", help=DEBUG_HELP)

    def error(self, message):
        raise UserError(f"{message} (see {self.prog} --help)")


def output_folder(path, flag: str = "OUT") -> Path:
    """``path`` as an output folder: created if missing, and proven to take files (a real
    write, so read-only mounts, quotas and ACLs count); a UserError naming ``flag`` otherwise.
    Inside a ``@command`` that then fails, the folders created here are removed if empty."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {path}: is a file, not a folder; pass a folder (created if missing)")
    missing = [q for q in [p, *p.parents] if not q.exists()]
    try:
        p.mkdir(parents=True, exist_ok=True)
        _CREATED.extend(q.absolute() for q in reversed(missing))
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror or e}); pass a folder "
                        "you can write to") from None
    return p


def format_duration(seconds: float) -> str:
    """45s, 12m05s, 3h07m."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta(remaining: float, done: float, elapsed: float) -> str:
    """The time ``remaining`` units take at the rate of ``done`` units in ``elapsed`` seconds
    ("?" before the first unit)."""
    if done <= 0 or elapsed <= 0:
        return "?"
    return format_duration(remaining * elapsed / done)


class ProgressLog:
    """Progress as log lines, for logs that are not a terminal (where no bar is drawn):
    ``what done/total unit (pct%), eta ...`` at every ``1/lines`` of the work, at most a minute
    apart, and at the end. ``update(done)`` after each unit."""

    def __init__(self, logger, what: str, total: int, unit: str = "", lines: int = 20,
                 enabled: bool = True):
        import time

        self.log, self.what, self.total, self.unit = logger, what, int(total), unit
        self.every, self.enabled = max(1, -(-self.total // lines)), enabled and total > 0
        self._clock = time.perf_counter
        self.t0 = self.last = self._clock()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = self._clock()
        if done == self.total or done % self.every == 0 or now - self.last >= 60:
            self.last = now
            self.log.info("%s %d/%d%s (%.0f%%), eta %s", self.what, done, self.total, self.unit,
                          100 * done / self.total, eta(self.total - done, done, now - self.t0))


class _NoBar:
    """What ``progress_bar`` returns off a terminal: a bar's calls, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress_bar(iterable=None, enabled: bool = True, **kw):
    """A tqdm bar where stderr is a terminal (and ``enabled``); elsewhere ``iterable`` itself,
    or (without one) a bar that does nothing. Without tqdm's monitor thread: tqdm starts it with
    its first bar, even a disabled one, and keeps it for the life of the process, and a process
    forked later (a loader worker, a test's ranks) can copy tqdm's lock while that thread holds
    it, then wait on it forever. (The monitor only redraws a bar whose updates slowed down.)"""
    if not (enabled and sys.stderr.isatty()):
        return _NoBar() if iterable is None else iterable
    from tqdm import tqdm

    tqdm.monitor_interval = 0
    return tqdm(iterable, **kw)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (test runners swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def setup_logging(quiet: bool = False) -> None:
    """INFO (WARNING when ``quiet``, e.g. ranks > 0) to stderr with a time stamp; one handler
    per process however often a command runs in it."""
    root = logging.getLogger()
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        h = _StderrHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        root.addHandler(h)
    root.setLevel(logging.WARNING if quiet else logging.INFO)


def drop_logging() -> None:
    """Undo ``setup_logging`` (for in-process callers such as tests)."""
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, _StderrHandler)]
    root.setLevel(logging.WARNING)
