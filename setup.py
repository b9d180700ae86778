"""CM-ACC: cross-modal active contrastive coding of audio-visual video representations."""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
setup(
    name="cmacc",
    version="0.1.0",
    description="Fast, faithful CM-ACC (Ma et al., ICLR 2021): audio-visual contrastive "
    "pretraining with active negative sampling, Triton kernels and DALI pipelines",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # subpackages too (cmacc.apps, data_dali.prepare): a plain `pip install .` needs them
    packages=find_packages(include=["cmacc", "cmacc.*", "kernels", "kernels.*", "data_dali", "data_dali.*"]),
    py_modules=["train"],
    install_requires=[
        "torch>=2.9",
        "torchvision>=0.24",
        "torchaudio>=2.9",
        "numpy>=1.26",
        "av>=14",
        "librosa>=0.10",
        "soundfile>=0.12",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "threadpoolctl>=3",  # kernels.reference: one BLAS thread for small k-means++ pools
    ],
    extras_require={
        "dali": ["nvidia-dali-cuda130>=2.4"],
        "test": ["pytest>=8", "pytest-benchmark>=4", "scikit-learn>=1.3", "scipy>=1.10"],
    },
    # the commands; each is also `python -m <module>` (and `torchrun train.py` for training)
    entry_points={"console_scripts": [
        "cmacc-train=train:main",
        "cmacc-prepare=data_dali.prepare:main",
        "cmacc-manifest=data_dali.manifest_tools:main",
        "cmacc-eval=cmacc.apps.eval:main",
        "cmacc-export=cmacc.apps.export:main",
        "cmacc-mi=cmacc.apps.mi:main",
        "cmacc-analysis=cmacc.apps.analysis:main",
    ]},
)
