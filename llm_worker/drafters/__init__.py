"""Drafting modes. Importing this package registers every built-in mode in ``DRAFTERS``."""

from llm_worker.drafters import pld, pld_plus  # noqa: F401  (registration side effect)
from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    ModeUnavailableError,
    UnknownModeError,
    parse_mode,
)

__all__ = ["DRAFTERS", "DraftContext", "Drafter", "ModeUnavailableError", "UnknownModeError", "parse_mode"]
