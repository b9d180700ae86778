"""Audio constants and the log-mel front end, in one place (paper appendix: librosa, 80 bands).

    sr 16 kHz mono · n_fft 512 · win 400 (25 ms) · hop 160 (10 ms → 100 mel frames per second)
    80 mel bands · log(mel power + 1e-6)

A video clip of T frames at fps F starting at t0 seconds pairs with mel frames
[round(100 t0), round(100 t0) + round(100 T / F)).
"""

from __future__ import annotations

import numpy as np

SR = 16_000
N_FFT = 512
WIN = 400
HOP = 160
N_MELS = 80
MEL_FPS = SR // HOP  # 100
LOG_EPS = 1e-6


def log_mel(wave: np.ndarray) -> np.ndarray:
    """[samples] float mono at SR → [N_MELS, frames] float32 log-mel."""
    import librosa

    mel = librosa.feature.melspectrogram(y=np.asarray(wave, dtype=np.float32), sr=SR, n_fft=N_FFT,
                                         hop_length=HOP, win_length=WIN, n_mels=N_MELS, power=2.0)
    return np.log(mel + LOG_EPS).astype(np.float32)


def mel_frames(frames: int, fps: float) -> int:
    """Mel frames that pair with ``frames`` video frames at ``fps``."""
    return int(round(frames * MEL_FPS / fps))


def mel_segment(mel: np.ndarray, start_frame: int, frames: int, fps: float) -> np.ndarray:
    """The mel segment aligned with video frames [start_frame, start_frame + frames); padded
    with the log floor if the audio is shorter than the video."""
    start = int(round(start_frame * MEL_FPS / fps))
    length = mel_frames(frames, fps)
    seg = np.array(mel[:, start:start + length], dtype=np.float32)  # a copy, not the mmap
    if seg.shape[1] < length:
        pad = np.full((mel.shape[0], length - seg.shape[1]), np.log(LOG_EPS), dtype=np.float32)
        seg = np.concatenate([seg, pad], 1)
    return seg
