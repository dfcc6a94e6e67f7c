"""Progress and an ETA on stderr for `python -m nimblejax.bench`, from prior estimates
of each model's seconds corrected by how long the done ones took."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from nimblejax.bench.configs import LOOPS, QUICK_CONFIGS

# Seconds one model × batch takes in the default run on one H100 (jax 0.11.2, measured
# 2026-11-24 on a fresh machine, then again with the compile caches filled): building the
# weights, jax.jit's first call, nimble's first call (plan, NVRTC, graph capture) and
# about 1.5 s of timing. (cold, warm): cold is the first run on a machine, when XLA
# compiles and autotunes every model (177 s of the suite's 281 s) and NVRTC compiles
# nimble's kernels; warm loads jax.jit's executables from JAX's persistent cache (NASNet's
# first execution still takes 25 s) and nimble's kernels from CuPy's cache. Only the
# estimate and the ETA use these.
PRIOR_S = {"mlp": (7.3, 2.5), "bert": (12.7, 3.3), "lstm": (7.1, 2.1), "resnet50": (9.4, 2.4),
           "mobilenet_v2": (19.3, 4.4), "efficientnet_b0": (19.6, 4.7),
           "inception_v3": (11.6, 2.7), "nasnet_mobile": (53.3, 28.6)}
PRIOR_PLAN_S = 0.6  # planning one model without a GPU (2 cores, CI)


def prior_s(model: str, batch: int, opts: argparse.Namespace, mode: str,
            warm: bool = False) -> float:
    """Expected seconds of one model × batch (the estimate and the ETA's starting point)."""
    if mode == "plan":
        return PRIOR_PLAN_S
    cold_s, warm_s = PRIOR_S.get(model, (5.0, 2.0))
    base = 1.0 if opts.tiny else (warm_s if warm and not opts.full else cold_s)
    extra_configs = max(0, len(opts.config_keys) - len(QUICK_CONFIGS))
    base *= 1.0 + 0.5 * extra_configs
    if opts.full:
        base *= 2.0  # cold and warm compiles of every nimble configuration
    if opts.repeat is not None:  # calls instead of a budget: about 2 ms a call on average
        timed = (3 if opts.full else 2) * LOOPS * opts.repeat * 0.002
        base += timed * len(opts.config_keys)
    return base



class Progress:
    """Progress and an ETA on stderr, never on stdout: one line per step where stderr is
    a log or a pipe, one updated status line on a terminal."""

    def __init__(self, units: list, prior: Callable[[Any], float], stream=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.units = list(units)
        self.prior = {u: float(prior(u)) for u in self.units}
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.t0 = clock()
        self.done: list = []
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._status = False

    @staticmethod
    def clock_text(seconds: float) -> str:
        seconds = max(0, int(round(seconds)))
        return f"{seconds // 60}m{seconds % 60:02d}s"

    def estimate_s(self) -> float:
        """Seconds still to go: the priors left, scaled by how far off the done ones were."""
        left = sum(self.prior[u] for u in self.units if u not in self.done)
        done_prior = sum(self.prior[u] for u in self.done)
        if done_prior > 0:
            left *= (self.clock() - self.t0) / done_prior
        return left

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
            self._status = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Before a line on stdout: take the status line off the terminal."""
        if self.tty and self._status:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._status = False

    def note(self, text: str) -> None:
        self.clear()
        self.stream.write(text + "\n")
        self.stream.flush()

    def step(self, text: str) -> None:
        n = len(self.done) + 1
        self._write(f"[{n}/{len(self.units)}] {text}  ({self.clock_text(self.clock() - self.t0)} "
                    f"elapsed, ETA {self.clock_text(self.estimate_s())})")

    def finish(self, unit) -> None:
        self.done.append(unit)

    def close(self) -> None:
        self.clear()
        self.note(f"done in {self.clock_text(self.clock() - self.t0)}")
