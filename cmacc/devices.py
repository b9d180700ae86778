"""What the installed torch needs from the NVIDIA driver, in words (the one-line CUDA errors)."""

from __future__ import annotations

import torch

# the oldest Linux driver of each CUDA release (NVIDIA's CUDA toolkit release notes)
MIN_DRIVER = {"13.0": "580.65.06", "12.9": "575.51.03", "12.8": "570.26", "12.6": "560.28.03",
              "12.4": "550.54.14", "12.1": "530.30.02", "11.8": "520.61.05"}


def cuda_needs() -> str:
    """What the installed torch needs from the driver and what nvidia-smi found, in words."""
    import shutil
    import subprocess

    built = torch.version.cuda
    need = (f"torch {torch.__version__} is a CPU-only build" if built is None else
            f"torch {torch.__version__} is built for CUDA {built}, which needs an NVIDIA driver "
            f">= {MIN_DRIVER.get(built, 'of CUDA ' + built)}")
    found = "no nvidia-smi on PATH (no NVIDIA driver?)"
    if shutil.which("nvidia-smi"):
        try:
            p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            drivers = sorted(set(p.stdout.split()))
            found = (f"driver {', '.join(drivers)}" if p.returncode == 0 and drivers else
                     f"nvidia-smi fails ({(p.stderr or p.stdout).strip()[:120] or p.returncode})")
        except (OSError, subprocess.SubprocessError) as e:
            found = f"nvidia-smi fails ({e})"
    return f"{need}; found: {found}"


def autotune_convolutions(device, on: bool) -> None:
    """On CUDA, cuDNN times its convolution algorithms for each new shape once and keeps the
    fastest (``torch.backends.cudnn.benchmark``): a training run's shapes are fixed, so this
    costs the first steps a little and every later step less (``--no-cudnn-benchmark``: the
    heuristic choice). Other devices: nothing changes."""
    if torch.device(device).type == "cuda":
        torch.backends.cudnn.benchmark = bool(on)
