"""The one error type of a setting that cannot run exactly (core: no torch, no TorchTitan)."""


class ConfigError(ValueError):
    """A setting that cannot run exactly; the message names it and the valid choices."""
