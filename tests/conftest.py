"""Shared fixtures: every contract test runs against the Rust manager and the reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

IMPLS = ("rust", "reference")


def manager_class(impl: str) -> type:
    """The manager class of one implementation."""
    if impl == "rust":
        from kvoffload import CPUOffloadingManager

        return CPUOffloadingManager
    from kvoffload.reference import CPUOffloadingManager as ReferenceManager

    return ReferenceManager


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_manager(impl: str) -> Callable[..., Any]:
    """``make_manager(num_chunks, **kwargs)`` builds a manager of the current implementation."""
    cls = manager_class(impl)

    def make(num_chunks: int, **kwargs: Any) -> Any:
        return cls(num_chunks, **kwargs)

    return make


@pytest.fixture(scope="session")
def oracle() -> Any:
    """vLLM 0.33.0's kv_offload modules (tools/vllm_oracle.py); skips (or fails) without them."""
    import _driver

    _driver.require_vllm()
    return _driver._load_tool("vllm_oracle").load()


@pytest.fixture(scope="session")
def vllm_mod(oracle: Any) -> Any:
    """``kvoffload.integrations.vllm``, once vLLM's modules are importable."""
    import kvoffload.integrations.vllm as integration

    return integration


@pytest.fixture
def saved_figures(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Path, dict[str, Any]]]:
    """Every (figure, path, keyword arguments) that ``Figure.savefig`` is called with; each
    figure is still saved."""
    from matplotlib.figure import Figure

    saves: list[tuple[Any, Path, dict[str, Any]]] = []
    real = Figure.savefig

    def savefig(fig: Any, path: Any, **kwargs: Any) -> None:
        saves.append((fig, Path(path), kwargs))
        real(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saves
