"""Signal processing (DFT, STFT, window functions, MelWeightMatrix) and Det."""

from __future__ import annotations
