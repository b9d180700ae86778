"""The fenced shell commands of README.md and docs/*.md, each run as a user would type it (scaled
down where it would take minutes) or skipped with the reason, so a command that stops working
fails here instead of in a reader's shell.

Each command is one test, named by its file, line and text: ``pytest tests/test_docs_commands.py
-v -rs`` lists which ran and which were skipped and why. The commands run in order, in one
working folder, with this checkout first on the path (what one command writes, the next reads:
``runs/demo`` and ``runs/tiny``), without a shell (``~/videos/my_set`` and the other stand-ins
below are substituted). Every command must have a line in ``PLAN``: a new command in the docs
without one fails ``test_every_documented_command_has_a_plan``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# the commands run in README order in one workspace (a run before its eval, an export before
# the eval of its file): never split over pytest-xdist workers, nor reordered (make test runs
# the serial tests in one process, in order)
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_TAGS = ("bash", "sh", "shell", "console")


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) of every command in a fenced bash/sh/shell/console block, and of every
    ``$ `` line of an untagged block (an example with its output); continuation lines joined,
    comments dropped."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            tag, body = m.group(1), m.group(2)
            first = text[:m.start(2)].count("\n") + 1
            lines = body.splitlines()
            if tag not in SHELL_TAGS:
                lines = [ln[2:] if ln.startswith("$ ") else "" for ln in lines]
            cmd, start = "", None
            for i, line in enumerate(lines):
                if start is None:
                    start = first + i
                cmd += line.rstrip()
                if cmd.endswith("\\"):
                    cmd = cmd[:-1] + " "
                    continue
                words = shlex.split(cmd, comments=True)
                if words:
                    out.append((f"{path.relative_to(ROOT)}:{start}", " ".join(words)))
                cmd, start = "", None
    return out


@dataclass
class Run:
    """Run the command, ``extra`` flags appended (argparse: the last value of a flag wins)."""
    extra: tuple = ()
    why: str = ""  # what the scaling changes


@dataclass
class Skip:
    reason: str


def _makefile_recipe(target: str) -> str:
    """The command a Makefile target runs (``$(PY)`` is this Python; the install step, which
    needs the network, is left out)."""
    lines = (ROOT / "Makefile").read_text().split(f"\n{target}:", 1)[1].splitlines()[1:]
    return next(ln.strip() for ln in lines if ln.startswith("\t")).replace("$(PY)", "python")


GPU = "needs a CUDA GPU: make gpu-check runs the GPU commands"
MINUTES = "minutes of CPU even scaled down: {}"
PLAN = [  # (regex matched against the command from its start, Run or Skip); first match wins
    (r"make (test|coverage)$", Skip("the test suite itself (this test is part of it)")),
    (r"make demo$", Skip(MINUTES.format("its MP4s are encoded and six runs pretrained and "
                                        "probed; runs/demo here is a stand-in (workspace)"))),
    (r"python -m data_dali\.prepare (UCF-101|hmdb51|ESC-50-master|kinetics400) ",
     Skip("needs that dataset downloaded")),
    (r"(python -m data_dali\.manifest_tools subset|python train\.py --data) data/ucf101/",
     Skip("needs UCF-101 prepared")),
    (r"python -m cmacc\.apps\.eval runs/ucf_train_only ", Skip("needs UCF-101 prepared")),
    (r"python -m data_dali\.prepare ~/videos data/my_set --layout list",
     Skip("needs your videos and their list file")),
    (r"python -m data_dali\.prepare ~/sounds ", Skip("needs a folder of your sounds")),
    (r"python -m data_dali\.prepare ~/videos/my_set ", Run(("--min-seconds", "0.5"),
                                                           "1-second synthetic clips")),
    (r"python -m data_dali\.synthetic ", Run(("--classes", "2", "--per-class", "2", "--seconds",
                                              "0.5"), "2 classes x 2 clips of 0.5 s")),
    (r"python -m data_dali\.manifest_tools merge data/ucf101 data/hmdb51 ",
     Skip("needs UCF-101 and HMDB51 prepared")),
    (r"python -m data_dali\.manifest_tools (stats|subset) runs/demo/", Run()),
    (r"python train\.py --preset tiny ", Run(("--steps", "2", "--clips", "24", "--classes", "4"),
                                             "2 steps, 24 clips")),
    (r"python train\.py --preset paper --data data/my_set/manifest\.csv ", Run(
        ("--device", "cpu", "--preset", "tiny", "--steps", "2", "--batch-size", "4", "--dict-size",
         "8", "--pool-size", "16", "--loader", "reference", "--workers", "0"),
        "on the CPU, tiny preset, 2 steps of 4 clips (the 12 prepared stand-in clips)")),
    (r"python train\.py .*--device cuda", Skip(GPU + " (and a prepared dataset)")),
    (r"torchrun .*--device cuda", Skip("needs several GPUs (and a prepared dataset)")),
    (r"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ", Skip(
        "several nodes and their GPUs; tests/test_elastic.py runs two agents on the loopback")),
    (r"export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1$", Skip("sets the shell's environment for "
                                                         "the torchrun command that follows")),
    (r"torchrun --nnodes=1:2 ", Skip("two agents at once, one per shell, and a node killed "
                                     "by hand; tests/test_elastic.py runs them")),
    (r"python -m cmacc\.apps\.plot ", Run()),
    (r"python -m cmacc\.apps\.eval runs/k400 ", Skip("needs Kinetics pretrained on and UCF-101 "
                                                       "prepared")),
    (r"python -m cmacc\.apps\.eval .*--protocol finetune", Run(("--epochs", "1", "--clips", "1"),
                                                              "1 epoch, 1 test clip a video")),
    (r"python -m cmacc\.apps\.eval ", Run(("--clips", "1"), "1 test clip a video")),
    (r"python -m cmacc\.apps\.analysis all ", Skip(MINUTES.format(
        "several pretraining runs per analysis; tests/test_analysis.py tests its parts"))),
    (r"python -m cmacc\.apps\.mi --omniglot ", Skip("needs Omniglot (torchvision's folders)")),
    (r"python -m cmacc\.apps\.mi --out runs/mi --report-only", Run()),  # the stored study
    (r"python -m cmacc\.apps\.mi --make-glyphs ", Skip(MINUTES.format(
        "glyph rendering and a pretraining run; tests/test_mi.py runs the study small"))),
    (r"python -m cmacc\.apps\.export ", Run()),
]
COMMANDS = documented_commands()


def plan_for(cmd: str):
    return next((action for pattern, action in PLAN if re.match(pattern, cmd)), None)


def test_every_documented_command_has_a_plan():
    missing = [f"{where}: {cmd}" for where, cmd in COMMANDS if plan_for(cmd) is None]
    assert not missing, "commands in the docs without a line in PLAN:\n" + "\n".join(missing)
    assert len(COMMANDS) > 20  # the extraction found the docs' blocks


def test_the_extraction_joins_continuations_and_reads_examples(tmp_path, monkeypatch):
    doc = tmp_path / "X.md"
    doc.write_text("```bash\n# a comment\npython a.py --x 1 \\\n    --y 2   # note\n```\n\n"
                   "```\n$ python b.py\n| output |\n```\n\n```python\nprint(1)\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", [doc])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert documented_commands() == [("X.md:3", "python a.py --x 1 --y 2"),
                                     ("X.md:8", "python b.py")]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_prepared, tiny_run):
    """The folder the commands run in, with the stand-ins: ``~/videos/my_set`` is a tiny
    synthetic class folder; ``runs/demo`` (what ``make demo`` leaves, skipped here) holds a
    tiny prepared dataset with a train/test split, as the demo's, and two tiny runs as
    ``xmoco`` and ``cmacc``; ``runs/mi`` holds the stored Omniglot study (its --report-only
    command rewrites the report from it)."""
    from data_dali import prepare as prep
    from data_dali import synthetic

    ws = tmp_path_factory.mktemp("docs")
    shutil.copytree(tiny_prepared[0], ws / "my_set")
    src = synthetic.write_dataset(ws / "demo_src", classes=2, per_class=6, seconds=1.0,
                                  width=32, height=24, fps=10)
    prep.prepare(src, ws / "runs" / "demo" / "data", layout="list", list_file=src / "list.csv",
                 workers=1, progress=False,
                 cfg=prep.PrepareConfig(short_side=16, min_seconds=0.5))
    for name in ("xmoco", "cmacc"):
        shutil.copytree(tiny_run, ws / "runs" / "demo" / name)
    (ws / "runs" / "mi").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "results" / "mi_omniglot" / "mi.json", ws / "runs" / "mi")
    return ws


def _argv(cmd: str, ws: Path) -> list[str]:
    if cmd.startswith("make "):
        cmd = _makefile_recipe(cmd.split()[1])
    words = shlex.split(cmd)
    subst = {"python": sys.executable, "train.py": str(ROOT / "train.py"),
             "~/videos/my_set": str(ws / "my_set"), "/tmp/glyphs": str(ws / "glyphs")}
    return [subst.get(w, w) for w in words]


@pytest.mark.parametrize("where,cmd", COMMANDS, ids=[f"{w} {c[:70]}" for w, c in COMMANDS])
def test_documented_command(where, cmd, workspace):
    action = plan_for(cmd)
    if action is None:
        pytest.fail("no line in PLAN for this command (test_every_documented_command_has_a_plan)")
    if isinstance(action, Skip):
        pytest.skip(f"{where}: {action.reason}")
    argv = _argv(cmd, workspace) + list(action.extra)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                  "")]),
           "MPLBACKEND": "Agg", "CMACC_KERNELS": "reference"}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(argv, cwd=workspace, env=env, capture_output=True, text=True,
                         timeout=300)
    scaled = f" (scaled: {action.why})" if action.why else ""
    assert res.returncode == 0, (f"{where}: `{cmd}`{scaled} exited {res.returncode}:\n"
                                 f"{res.stderr[-3000:]}")
