"""What every prepared clip looks like (PrepareConfig), the media a source may be, and how
preparing fails: PrepareError (a mistake in the command or an unwritable OUT: stops the run)
and Reject (one unusable file: written to rejects.csv, the run goes on).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cli import UserError

VIDEO_EXT = {".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v", ".mpg", ".mpeg", ".flv", ".ogv",
             ".3gp", ".wmv", ".ts"}
AUDIO_EXT = {".wav", ".flac", ".ogg", ".mp3", ".m4a", ".aac", ".opus"}
OUTPUTS = (".webm", ".flac", ".mel.npy")  # appended to clips/<source path>


class PrepareError(UserError, ValueError):
    """A mistake in what prepare was asked (paths, flags, list and split files), or an output
    folder it cannot write (full disk, no permission): the message names it and the fix."""


@dataclass
class PrepareConfig:
    """What every prepared clip looks like. A change re-prepares the affected files."""

    fps: float = 10.0  # paper: 10 fps
    short_side: int = 128  # so 112 crops work; 256 for 224 crops
    min_seconds: float = 1.6  # 16 frames at 10 fps: one pretraining clip
    mel: bool = True  # precompute the log-mel (.mel.npy); otherwise loaders compute it
    crf: int = 32  # VP9 constant quality (lower = better, larger files)

    def __post_init__(self):
        if not 0 < self.fps <= 120:
            raise PrepareError(f"--fps must be in (0, 120], got {self.fps}")
        if self.short_side < 16 or self.short_side % 2:
            raise PrepareError(f"--short-side must be an even number >= 16, got {self.short_side}")
        if not 0 <= self.min_seconds < float("inf"):
            raise PrepareError(f"--min-seconds must be >= 0, got {self.min_seconds}")
        if not 0 <= self.crf <= 63:
            raise PrepareError(f"--crf must be in [0, 63] (VP9), got {self.crf}")


class Reject(Exception):
    """A file that cannot be used; the message is the reason written to rejects.csv."""


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:100]}"
