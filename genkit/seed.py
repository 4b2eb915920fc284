"""``genkit.set_seed``: seed every random number generator a generation may draw from."""

from __future__ import annotations

import logging
import random
from numbers import Integral

from .errors import ConfigError

logger = logging.getLogger("genkit.seed")


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch (CPU and every CUDA device), as
    ``transformers.set_seed`` does, so that sampling is reproducible.

    ``deterministic=True`` also makes torch use deterministic algorithms where it has them
    (``torch.use_deterministic_algorithms(True)``; slower on some GPU kernels).

    >>> import genkit
    >>> genkit.set_seed(0)
    """
    if not isinstance(seed, Integral) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ConfigError(f"`seed` must be an int in [0, 2**32) (NumPy's range); got {seed!r}")
    if not isinstance(deterministic, bool):
        raise ConfigError(f"`deterministic` must be True or False; got {deterministic!r}")
    seed = int(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        logger.debug("numpy is not installed; not seeding it")
    else:
        np.random.seed(seed)
    import torch

    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)  # a no-op without CUDA
    if deterministic:
        torch.use_deterministic_algorithms(True)
