"""The mutual-information study (paper appendix; Ozair et al. 2019, Spatial-MultiOmniglot).
Installed as the command ``cmacc-mi`` (= ``python -m cmacc.apps.mi``).

A pair (x, y) shows l characters in a near-square grid of 32x32 cells. Position i draws its
character z_i uniformly from the i-th alphabet (l_i characters); the alphabets are taken
largest first, whole (the paper's 9: Tifinagh 55, Hiragana 52, Gujarati 48, Katakana 47,
Bengali 46, Grantha 43, Sanskrit 42, Armenian 41, Mkhedruli 41; Omniglot's background set
small1 + small2 has Katakana 47, Sanskrit 42, Korean 40, Latin 26, Balinese 24, Greek 24,
Early_Aramaic 22, Tagalog 17). In y, position i shows character (z_i + 1) mod l_i of the same
alphabet (``relation="next"``, Ozair et al.'s construction as public reproductions build it;
the CM-ACC appendix does not restate it) or z_i itself (``"same"``), always drawn by another
person. Either way I(x; y) = sum_i log l_i (nats) grows with l.

The protocol (defaults): 50,000 training pairs drawn by drawers 0..13, test pairs by the
other drawers (unseen handwriting); the pairs are stored as indices (character, drawer per
position) and rendered on demand, per batch, from a uint8 glyph bank (~0.25 MB per alphabet).
SMoCo (x vs an augmented x), XMoCo and CM-ACC (x vs y) train a small CNN per modality with the
paper's optimiser and sizes (Adam 1e-3, M = 128, K = 30 M, m = 0.999, tau = 0.7) at every l
of ``--chars``, 3 seeds; the other samplers of the cross-modal objective (active-feature,
OHEM) run at ``--sampler-chars`` (the two largest l >= 3). A run stops at a plateau of its
loss (``--tol``/``--patience``/``--min-steps``) or at ``--max-steps``; a linear probe of the
character at every position reads the frozen x-encoder's backbone features (mean accuracy
over positions), beside the untrained and raw-pixel floors. ``report.md`` lists every
departure from the paper's protocol (CPU-sized: a 100-step warm-up, a pool of 60 M = 2 K
candidates, encoder width 16), gives paired differences between the objectives per seed, and
the run times; ``mi_curves.png`` shows each run's loss and pretext accuracy. The probe is
scored on two test sets: pairs drawn by held-out drawers (unseen handwriting, the protocol)
and new pairs of the training drawers' own drawings (seen images).

Every run also records the diversity of the negatives it enqueues, by the real characters of
the enqueued pairs, position by position (unique/M and coverage as ``cmacc.metrics`` defines
them; ``train.character_diversity`` says why per position): per window and over the second
half of training. ``report.md`` tables it per l and sampler beside random sampling's law,
with each sampler minus random (XMoCo) paired by seed; ``mi_diversity.png`` draws it. Every
10th step a run also measures how fresh the keys it just enqueued are: their cosine to the same
pairs' keys by the current key encoders (1 = encoded now), without changing the run.
``--fresh-picks`` re-encodes the active samplers' picks by the current key encoders before
they are enqueued (a departure from Algorithm 1, which enqueues the pool's keys, as old as the
pool): what the pool's staleness costs, measured.
``--pool-mode epoch`` gives the active samplers the paper's per-epoch candidate pools (N random
training pairs through the key encoders at each epoch start; an epoch = one pass over the
training pairs at batch M) instead of the rolling pool.

``mi.json`` is rewritten after every run (``"complete": false`` until the last one is in):
the same command again resumes a stopped study, training only the runs that are missing
(other settings are an error naming what differs), and ``--report-only`` writes the report
and plots of what is there. Runs that one study cannot hold (another ``--max-steps``, e.g.
XMoCo given CM-ACC's compute) go in another ``--out``; ``python -m cmacc.apps.mi.compare
A:CM-ACC B:XMoCo`` pairs two studies' runs by seed. docs/FIDELITY.md §4 and §7 have what this
shows.

    python -m cmacc.apps.mi --omniglot ROOT --out runs/mi [--chars 1 2 3 4 6 8] [--seeds 0 1 2]
    python -m cmacc.apps.mi --out runs/mi --report-only
    python -m cmacc.apps.mi --make-glyphs /tmp/glyphs --quick --out runs/mi_quick

ROOT is the folder that holds ``omniglot-py/images_background`` (torchvision's layout).
``--make-glyphs DIR`` writes a small generated stand-in in that layout (for trying the command
without Omniglot); ``--quick`` is a minutes-long setting for tests, not a result.
"""

from .cli import main, report_only
from .data import (CELL, PAPER_ALPHABET_SIZES, PAPER_TRAIN_PAIRS, RELATIONS, TRAIN_DRAWERS, Glyphs,
                   MultiOmniglotPairs, OmniglotError, check_glyphs, grid_shape, ink_to_float,
                   make_glyphs, mutual_information, to_ink_uint8)
from .nets import GroupBatchNorm2d, SmallCNN, augment
from .probe import features, pixel_features, probe_accuracy
from .report import paired_difference, report, write_outputs
from .study import default_sampler_chars, departures, diversity_law, machine, plan, run
from .train import (ALL_METHODS, DEPARTURE_WHY, DIVERSITY, METHODS, PAIRS, PAPER_CONFIG, QUICK,
                    QUICK_PAIRS, SAMPLERS, MIConfig, PairsLoader, ShuffledKeysCMACC, build_model,
                    character_diversity, loss_plateaued, plateau_step, selects, train_one)

__all__ = [n for n in dir() if not n.startswith("_")]
