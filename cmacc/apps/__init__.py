"""The applications built on the CM-ACC library, each a command:

    python -m cmacc.apps.demo       the CPU demo (make demo): prepare, pretrain, probe, compare
    python -m cmacc.apps.eval       linear probe / fine-tuning of a pretrained checkpoint
    python -m cmacc.apps.analysis   the paper's analyses (diversity, dictionary size, gallery, ...)
    python -m cmacc.apps.mi         the Spatial-MultiOmniglot mutual-information study
    python -m cmacc.apps.plot       training curves of runs to a PNG

Apps import the library (cmacc.*, kernels, data_dali); the library never imports an app.
"""
