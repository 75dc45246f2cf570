"""Which documents are held out of training for validation: a seeded rule on (dataset name, record).

The rule depends on nothing but the dataset's name (the name positions are saved under: a cached corpus's
file name, else its path), its record count, the share and data.seed, so every run, layout and resume
holds out the same documents, and training never draws one of them.
"""

import zlib

import numpy as np


def held_out(name: str, documents: int, share: float, seed: int) -> np.ndarray:
    """[documents] bool: True for the records held out of training."""
    rng = np.random.default_rng([seed, zlib.crc32(f"heldout:{name}".encode())])
    return rng.random(documents) < share
