"""Host seconds per named phase of the engine step, summed over steps: `with timer("emit"): ...`.

Phases do not nest (one timer, one phase open at a time). The engine process reads `seconds`
for its operator log and slow-step log, and resets them by assigning a fresh list.
"""

from __future__ import annotations

from time import perf_counter


class PhaseTimer:
    __slots__ = ("_i", "_index", "_t0", "names", "seconds")

    def __init__(self, names: tuple[str, ...], seconds: list[float] | None = None):
        self.names = names
        self.seconds = seconds if seconds is not None else [0.0] * len(names)  # parallel to names
        self._index = {n: i for i, n in enumerate(names)}
        self._i, self._t0 = 0, 0.0

    def __call__(self, phase: str) -> PhaseTimer:
        self._i = self._index[phase]
        return self

    def __enter__(self) -> None:
        self._t0 = perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds[self._i] += perf_counter() - self._t0
