"""Errors a user can act on: each names the argument, the limit and the value (rule 8)."""
from __future__ import annotations


class ApplianceError(Exception):
    """Base class of every error the appliance raises on purpose."""


class ModelLoadError(ApplianceError):
    """A model path, file or config that cannot be loaded; the message names the file."""


class InvalidRequestError(ApplianceError, ValueError):
    """A request the engine refuses. ``param`` names the offending argument (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
