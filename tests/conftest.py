"""Shared fixtures. Tests run on CPU; torch uses both cores."""

import pytest

import train


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A 6-step tiny-preset pretraining run on synthetic clips (run folder with checkpoint)."""
    out = tmp_path_factory.mktemp("tiny_run")
    train.main(["--preset", "tiny", "--clips", "96", "--classes", "6", "--steps", "6",
                "--log-every", "3", "--out", str(out)])
    return out
