"""Errors a user can act on: each message names the problem and the fix."""


class AdaspecError(Exception):
    """Base class: the CLI prints these as one line and exits with code 2."""


class InputError(AdaspecError, ValueError):
    """Bad request input: prompt, sampling parameters, lengths, method names."""


class ModelStoreError(AdaspecError):
    """A model could not be assembled, verified or loaded."""
