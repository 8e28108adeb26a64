"""A benchmark run beside other work measures that work: figures moved 2-3x with a test suite or
a helper on the machine. Each speed script asks here first and refuses to report when the load
average is above 0.5 per core, unless `--loaded` asks for figures anyway, which then say so."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

QUIET_PER_CORE = 0.5


@dataclass(frozen=True)
class Load:
    average: float  # the last minute's, as the kernel reports it
    cores: int

    @property
    def per_core(self) -> float:
        return self.average / self.cores

    @property
    def quiet(self) -> bool:
        return self.per_core <= QUIET_PER_CORE

    def __str__(self) -> str:
        return f"load average {self.average:.2f} on {self.cores} cores ({self.per_core:.2f} per core)"


def current_load() -> Load:
    return Load(os.getloadavg()[0], os.cpu_count() or 1)


def add_loaded_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--loaded",
        action="store_true",
        help=f"measure even above {QUIET_PER_CORE} load per core (the figures are marked as measured under load)",
    )


def require_quiet(*, loaded_ok: bool, load: Load | None = None) -> Load:
    """The machine's load, printed; a one-line refusal (exit 2) when it is loaded and that was not asked for."""
    load = load or current_load()
    if load.quiet:
        print(f"machine: {load}: quiet")
    elif loaded_ok:
        print(f"machine: {load}: MEASURED UNDER LOAD (--loaded), the figures include the other work")
    else:
        print(
            f"{os.path.basename(sys.argv[0])}: {load}, above {QUIET_PER_CORE} per core: the figures would measure "
            "the other work; run it on a quiet machine, or pass --loaded to measure anyway",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return load
