"""The generation core: inputs, processors, stopping criteria, outputs and ``generate``."""
