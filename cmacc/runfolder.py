"""Which run an output folder holds, for the trainer (``Trainer`` inherits ``RunFolder``): one
writer at a time (rank 0's lock), one run per folder (another run's checkpoints are refused, never
overwritten), the checkpoint to resume from (chosen by rank 0, loaded by every rank), and the data
a run goes on with. Every decision is rank 0's, told to every rank, so ranks never disagree on
which run they continue; every refusal is one line naming the folder and the fix."""

from __future__ import annotations

import logging
from pathlib import Path

from data_dali.cli import UserError, output_folder
from data_dali.fileio import FolderBusy, FolderLockError, hold_folder, sweep_temporaries

from . import checkpoint as ckpt
from . import distributed as du
from .config import NOT_SET, DataConfig, as_flag, config_differences
from .data import data_record, describe_data

log = logging.getLogger("cmacc")


class UsageError(UserError, ValueError):
    """A mistake in what the user asked for (flags, files, devices): the message says which and
    what to do. ``train.py`` prints it as one line and exits 2."""


class RunFolder:
    """The trainer's run-folder decisions; they read ``self.out``, ``self.cfg``, ``self.rank``,
    ``self.restart`` (whether this attempt is a torchrun restart, as every rank agreed it),
    ``self.chash`` and ``self.data``, and set ``self.held`` and ``self.run_id``."""

    def _prepare_out(self):
        """OUT exists, is a writable folder, and holds no half-written file of a killed run (nor
        the agreed stop of an earlier torchrun job: this is a new command)."""
        out = output_folder(self.out, "--out")
        self._hold_out(out)
        if self.rank == 0 and not self.restart:  # (the attempt as every rank agreed it)
            ckpt.clear_stop(out)
        if self.rank == 0:
            n = sweep_temporaries(out)
            if n:
                log.info("removed %d half-written file(s) of an interrupted run in %s", n, out)

    def _hold_out(self, out):
        """Rank 0 locks OUT for the run: a second command on the same folder (the same command
        started twice, in another shell or by a scheduler's retry) is refused on every rank,
        in one line naming the holder, before it reads or writes anything. A torchrun restart
        of this job (a lost rank or node) goes on if the lock is still held: its holder is this
        job's own lost process (a dead node's lock can outlive it on a network filesystem),
        and a lost node is a pause, not the end. A lock file that cannot be written (no
        permission, a full disk) stops every rank in the same line too."""
        def hold():  # rank 0; every rank raises its error (none waits in a collective)
            try:
                self.held = hold_folder(out)
            except FolderBusy as e:
                if not self.restart:
                    raise UsageError(str(e)) from None
                log.warning("%s; continuing, as torchrun restart %d of this job (the holder "
                            "is taken to be its own lost process)", e, self.restart)
            except FolderLockError as e:
                raise UsageError(str(e)) from None

        du.agree(hold)

    def _find_resume(self):
        """(path, state) to resume from, or None to start; sets the run id. Rank 0 chooses (a
        lagging NFS listing must not give ranks different checkpoints: they would hang in a
        collective or diverge) and every rank loads its choice; a rank that cannot read it stops
        every rank in one line."""
        chosen = None

        def choose():  # rank 0
            nonlocal chosen
            chosen = self._choose_resume()
            return (str(chosen[0]) if chosen else None,
                    int(chosen[1]["step"]) if chosen else None, self.run_id)

        path, step, self.run_id = du.agree(choose)
        why = None
        if path is not None and self.rank != 0:
            try:
                chosen = (Path(path), ckpt.validate(path, ckpt.load(path)))
                if int(chosen[1]["step"]) != step:
                    why = f"it holds step {chosen[1]['step']}, not {step}"
            except Exception as e:  # noqa: BLE001 - said on every rank below
                why = str(e) if isinstance(e, ValueError) else ckpt.why_unloadable(e)
        for r, w in enumerate(du.gather_objects(why)):
            if w is not None:
                raise UsageError(f"rank {r} cannot read checkpoint {path} that rank 0 chose to "
                                 f"resume from ({w}); if --out is on a network filesystem that "
                                 "is still syncing, run the same command again")
        return chosen

    def _choose_resume(self):
        """``_find_resume``'s choice, on rank 0. A folder holds one run: starting afresh where
        another run's checkpoints are is refused, not overwritten."""
        resume, out = self.cfg.run.resume, self.out
        if self.restart and resume != "auto":  # (agreed: _agree_on_the_attempt)
            # torchrun restarted the workers of this job: its newest checkpoint is the one to go on from
            log.info("torchrun restart %d: resuming from the newest valid checkpoint in %s "
                     "(--resume %s applies to the first attempt only)", self.restart, out,
                     resume)
            resume = "auto"
        try:
            info = ckpt.read_run(out)
        except ValueError as e:
            raise UsageError(str(e)) from None
        found = None
        if resume == "auto":
            found = ckpt.find_latest_valid(out, info["run_id"] if info else None)
        elif resume != "none":
            try:
                found = (Path(resume), ckpt.validate(resume, ckpt.load(resume)))
            except Exception as e:
                why = str(e) if isinstance(e, ValueError) else ckpt.why_unloadable(e)
                raise UsageError(f"--resume {resume}: not a readable checkpoint of train.py "
                                 f"({why}); "
                                 "pass a ckpt_*.pt file, 'auto' or 'none'") from None
            if info and found[1].get("run_id") != info["run_id"]:
                raise UsageError(f"--out {out} holds run {info['run_id']}; resuming the run of "
                                 f"{resume} there would mix two runs: use another --out")
        if found is not None:
            path, state = found
            if state.get("config_hash") != self.chash:
                raise UsageError(self._other_config(path, state))
            self._same_data(path, state)
            self.run_id = state.get("run_id") or ckpt.new_run_id()
            return found
        theirs = sorted(p.name for p in out.glob("ckpt_*.pt"))
        if info and resume == "auto":  # the run never wrote a valid checkpoint: start it again
            self.run_id = info["run_id"]
            log.info("run %s in %s has no valid checkpoint: starting it from step 0",
                     self.run_id, out)
        elif info or (resume == "none" and theirs):
            who = f"run {info['run_id']}" if info else "checkpoints"
            listed = ", ".join(theirs[-3:]) or "no checkpoint yet"
            raise UsageError(f"--out {out} already holds {who} ({listed}); continue it with "
                             "--resume auto, or start the new run in another --out (nothing "
                             "there is overwritten or deleted)")
        else:
            self.run_id = ckpt.new_run_id()
        return None

    def _other_config(self, path, state) -> str:
        """The line refusing a checkpoint of another model/selection config: each field that
        counts in its config hash and differs, with the checkpoint's value and the new one, and
        the flags that resume it."""
        try:
            diff = config_differences(state.get("config") or {}, self.cfg.model, self.cfg.selection)
        except Exception:  # noqa: BLE001 - a config this version cannot read: no field named
            diff = []
        if not diff:
            return (f"checkpoint {path} was made with another model/selection config (its "
                    "recorded fields match this command's: written by another version of "
                    "cmacc?); use another --out, or that version")
        said = "; ".join(f"{as_flag(n, a) if a != NOT_SET else n + ' ' + NOT_SET} in the "
                         f"checkpoint, {as_flag(n, b)} now" for n, a, b in diff)
        back = " ".join(as_flag(n, a) for n, a, _ in diff if a != NOT_SET)
        return (f"checkpoint {path} was made with another model/selection config: {said}; "
                f"resume it with {back or 'the flags of that run'}, or start this config in "
                "another --out")

    def _same_data(self, path, state) -> None:
        """A run goes on with the data it trained on: its dictionaries and pools hold row
        positions of those clips, and eval and the model card name that data. Another manifest
        (another SHA-256) or other synthetic clips are refused in one line; the same manifest's
        bytes at another path (a moved or copied dataset folder) go on, logged, and the run's
        checkpoints record the new path from then on."""
        if self.data.get("source") != "synthetic" and self.data.get("manifest_sha256") is None:
            return  # --data names no file: the loader says so, in one line
        theirs = state.get("data")
        if not isinstance(theirs, dict):  # written before checkpoints recorded their data
            theirs = data_record(DataConfig(**state["config"]["data"]))
        digest = self.data.get("manifest_sha256")
        if (theirs != self.data and digest is not None and theirs.get("manifest_sha256") == digest
                and theirs.get("source") != "synthetic"):  # the same bytes at another path
            log.info("the manifest has moved: checkpoint %s was trained on %s, and %s holds the "
                     "same bytes (sha256 %s); going on with %s, which this run's checkpoints "
                     "name from now on", path, theirs.get("source"), self.data["source"],
                     digest[:12], self.data["source"])
            return
        if theirs != self.data:
            raise UsageError(
                f"--data {describe_data(self.data)}: checkpoint {path} was trained on "
                f"{describe_data(theirs)}; its dictionaries and pools hold row positions of that "
                "data, so it continues only on it: pass that --data, or start a new run on this "
                "data in another --out")
