"""Progress bars: drawn on a terminal, nothing elsewhere, and never a thread left behind (tqdm's
monitor: a process forked after it could copy tqdm's lock held by it, and hang)."""

import io
import threading

from data_dali.cli import progress_bar


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_off_a_terminal_there_is_no_bar_and_no_thread(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    before = set(threading.enumerate())
    items = [1, 2, 3]
    assert progress_bar(items, desc="x") is items
    with progress_bar(total=3, desc="x") as bar:
        bar.update(1)
    assert progress_bar(items, enabled=True) is items
    assert set(threading.enumerate()) == before


def test_on_a_terminal_a_bar_is_drawn_unless_disabled_and_no_thread_is_left(monkeypatch):
    from tqdm import tqdm

    monkeypatch.setattr(tqdm, "monitor_interval", 10)  # tqdm's default (a test may have set 0)
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    before = set(threading.enumerate())
    assert list(progress_bar(range(3), desc="work", file=term)) == [0, 1, 2]
    assert "work" in term.getvalue() and "3/3" in term.getvalue()
    items = [1]
    assert progress_bar(items, enabled=False) is items
    assert set(threading.enumerate()) == before
