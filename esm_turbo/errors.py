"""Exceptions raised for bad user input; each message names the thing the user gave."""

from __future__ import annotations


class EsmTurboError(ValueError):
    """Base class: bad input to esm_turbo (a file, a record, a tensor, a checkpoint)."""


class FastaError(EsmTurboError):
    """A FASTA file or one of its records cannot be used."""


class CheckpointError(EsmTurboError):
    """A calibration checkpoint is truncated, malformed or made for another model."""


class ModelLoadError(EsmTurboError):
    """An ESM-2 model could not be loaded from the given id or path."""
