"""The registry of drafting modes: a mode registered for a ``with`` block exists only inside it."""

from __future__ import annotations

import pytest

from llm_worker.drafters.base import DrafterRegistry, NoDrafter, UnknownModeError


def make(target: object, options: dict[str, str], resources: object) -> NoDrafter:
    return NoDrafter()


def test_a_mode_registered_for_a_block_is_gone_after_it_even_on_error() -> None:
    registry = DrafterRegistry()
    registry.register("kept", "stays")(make)
    with registry.registered("brief", "a while", make, options=("x",)):
        assert registry.names() == ["kept", "brief"]
        assert registry.spec("brief").options == ("x",)
    assert registry.names() == ["kept"]
    with pytest.raises(UnknownModeError, match="unknown mode 'brief'"):
        registry.spec("brief")
    with pytest.raises(RuntimeError, match="boom"), registry.registered("brief", "a while", make):
        raise RuntimeError("boom")
    assert registry.names() == ["kept"]


def test_a_taken_name_is_refused_and_stays_registered() -> None:
    registry = DrafterRegistry()
    registry.register("kept", "stays")(make)
    with pytest.raises(ValueError, match="registered twice"), registry.registered("kept", "again", make):
        pass
    assert registry.names() == ["kept"] and registry.spec("kept").summary == "stays"
