"""Prepare a dataset for the loaders: source media in, uniform clips and a manifest out.
Installed as the command ``cmacc-prepare`` (= ``python -m data_dali.prepare``).

Probe every file (PyAV), transcode video to VP9 in WebM (DALI decodes VP9 on CPU and GPU;
H.264 only on GPU) at a constant frame rate and short side, resample audio to 16 kHz mono FLAC,
precompute the 80-band log-mel, and write the manifest (the only thing loaders read).

    python -m data_dali.prepare SRC OUT                            # SRC/<class>/<video files>
    python -m data_dali.prepare SRC OUT --layout list --list files.csv   # path,label[,split]
    python -m data_dali.prepare SRC OUT --layout list --list files.txt   # 'path label' lines
    python -m data_dali.prepare UCF-101 OUT --layout ucf101 --splits ucfTrainTestlist
    python -m data_dali.prepare hmdb51 OUT --layout hmdb51 --splits testTrainMulti_7030_splits
    python -m data_dali.prepare ESC-50-master OUT --layout esc50   # audio/*.wav + meta/esc50.csv
    python -m data_dali.prepare kinetics400 OUT --layout kinetics --splits annotations  # *.csv
    python -m data_dali.prepare kinetics400 OUT --layout kinetics \\
        --splits kinetics400/kinetics400_train_list_videos.txt     # mmaction's 'path label' list
    python -m data_dali.prepare SOUNDS OUT --audio-only            # SRC/<class>/<audio files>

Outputs: OUT/clips/<path in SRC>.webm|.flac|.mel.npy (prepared media, named after the whole
source path with its extension, so no two sources share an output), OUT/manifest.csv,
OUT/rejects.csv (file, reason), OUT/records/ (one small JSON per source file: what was done,
for resuming), OUT/src.json (the SRC that OUT follows) and a summary of what was kept, noted
and rejected, by reason. Bad inputs never stop the run and are never dropped silently: each is
either handled (and noted in the manifest's ``notes`` column) or written to rejects.csv. A
mistake in the command (paths, flags, list and split files) or an output disk that is full or
cannot be written stops it with one line (exit 2; ``--debug`` shows the traceback), before the
work where it can be known. Every output is written atomically (data_dali/fileio.py); a
re-run, also after a crash or ``kill -9``, skips files whose source and settings are unchanged
(a no-op when nothing changed; ``--retry-rejects`` tries rejected files again). An OUT
prepared from another SRC is refused (its manifest would be replaced by this source's):
prepare into another OUT, or pass ``--new-src`` when SRC is that data moved or should replace
it. Class folders named like splits (train/, val/, test/) are refused (a probe would learn
the split; ``--split-folders-are-classes`` if they are classes), and a note that goes with one
class (its share there far from its share in the others: 31 of 36 "typing" clips silent, none
of the rest) is one warning naming the class and both shares.

The package, one job per file: ``config`` (settings, errors), ``sources`` (layouts and
splits), ``transcode`` (one file), ``outputs`` (names under OUT, disk space), ``records``
(resuming) and ``run`` (the run and the command line).
"""

from .config import AUDIO_EXT, OUTPUTS, VIDEO_EXT, PrepareConfig, PrepareError, Reject
from .records import RECORD_VERSION
from .run import FIELDS, main, prepare
from .sources import LAYOUTS, scan
from .transcode import process

__all__ = ["AUDIO_EXT", "FIELDS", "LAYOUTS", "OUTPUTS", "RECORD_VERSION", "VIDEO_EXT",
           "PrepareConfig", "PrepareError", "Reject", "main", "prepare", "process", "scan"]
