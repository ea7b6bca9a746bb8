"""Drafting modes. Importing this package registers every built-in mode in ``DRAFTERS``."""

from llm_worker.drafters import dresd, edd, fuse, glide, pld, pld_plus, recycle, rest, suffix  # noqa: F401  (registration side effect)
from llm_worker.drafters.base import (
    DRAFTERS,
    DraftContext,
    Drafter,
    DraftResources,
    ModeUnavailableError,
    RequestState,
    UnknownModeError,
    canonical_mode,
    parse_mode,
)

__all__ = [
    "DRAFTERS",
    "DraftContext",
    "DraftResources",
    "Drafter",
    "ModeUnavailableError",
    "RequestState",
    "UnknownModeError",
    "canonical_mode",
    "parse_mode",
]
