"""Errors that name the problem and the fix; raised for bad input, never for bugs."""


class OnepassError(Exception):
    """Base class for input errors the harness reports without a traceback."""


class GGUFError(OnepassError, ValueError):
    """A GGUF file that cannot be used: unknown architecture, unsupported tensor type,
    missing tensor, wrong shape, or a truncated / corrupt file."""


class ConfigError(OnepassError, ValueError):
    """A run configuration that cannot work (prompt longer than the context, pool too small, ...)."""
