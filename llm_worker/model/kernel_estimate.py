"""How long choosing the GEMM kernels (``kernels.measure_kernels``) will take here, roughly: the
estimate behind its progress lines. Apart from ``kernels`` for size."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

INVARIANT_SHARE = 0.5
"""About the share of candidates that prove invariant and are timed, a guess: the others stop
at their check's first difference. On the tiny test model, on a loaded 2-core EPYC: 131 s
estimated (174 s with every candidate timed), 87 s taken."""


def estimate_seconds(
    weights: Mapping[str, Sequence[tuple[torch.Tensor, torch.Tensor | None]]],
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
) -> tuple[dict[str, float], float, int]:
    """Rough seconds ``measure_kernels`` spends per candidate of each role, per assignment
    ``choose_in_order`` times, and about how many assignments it times. A product of n rows
    through one layer of a role is priced a + b·n (a: reading the weight and calling, which a
    single row costs; b: each row's arithmetic), from one ``F.linear`` pass over the role's
    layers with 1 row and one with ``max(TIME_ROWS)`` (well under 1 % of the work). A candidate
    costs ``repeats`` + 1 passes at every ``TIME_ROWS`` count and its check (a product of every
    ``CHECK_ROWS`` count and a row alone at each place compared, on one layer); an assignment
    ``repeats`` + 1 passes over every role at ``FORWARD_ROWS``; only invariant candidates are
    timed (``INVARIANT_SHARE``). Within a factor of two or so; the progress lines' time left
    extrapolates the time actually spent, so it corrects itself."""
    from llm_worker.model.kernels import (
        ALL_PLACES_UP_TO,
        CHECK_ROWS,
        FORWARD_CANDIDATES,
        FORWARD_ROWS,
        LIBRARIES,
        ROLES,
        TIME_ROWS,
    )

    def product(role: str, n: int) -> float:  # seconds of n rows through one layer of the role
        a, b = cost[role]
        return a + b * n

    cost: dict[str, tuple[float, float]] = {}
    for role in ROLES:
        layers = weights[role]
        big = max(TIME_ROWS)
        x = torch.full((big, layers[0][0].shape[1]), 0.1, dtype=dtype, device=device)
        seconds = []
        for n in (1, big):
            begin = time.perf_counter()
            for w, b in layers:
                F.linear(x[:n], w, b)
            seconds.append((time.perf_counter() - begin) / len(layers))
        per_row = max(0.0, seconds[1] - seconds[0]) / (big - 1)
        cost[role] = (max(0.0, seconds[0] - per_row), per_row)
    singles = ALL_PLACES_UP_TO + 2 * len(CHECK_ROWS)
    per_candidate = {
        role: INVARIANT_SHARE * (repeats + 1) * len(weights[role]) * sum(product(role, n) for n in TIME_ROWS)
        + sum(product(role, n) for n in CHECK_ROWS)
        + singles * product(role, 1)
        for role in ROLES
    }
    per_assignment = (repeats + 1) * sum(
        len(weights[role]) * product(role, n) for role in ROLES for n in FORWARD_ROWS
    )
    return per_candidate, per_assignment, 1 + len(LIBRARIES) + len(ROLES) * FORWARD_CANDIDATES
