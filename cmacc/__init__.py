"""CM-ACC: cross-modal active contrastive coding of audio-visual video representations
(Ma et al., ICLR 2021). The method in PyTorch; active selection runs through ``kernels``."""

__version__ = "0.1.0"
