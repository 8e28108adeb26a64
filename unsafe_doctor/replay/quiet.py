"""Frameworks' import-time warnings kept off the user's stderr.

Megatron-core warns, on import, that Transformer Engine and Apex are missing and that it falls back
to its own code (megatron/core/optimizer/__init__.py, optimizer.py, clip_grads.py, and
distributed/fsdp/.../mixed_precision.py). A replay on CPU imports megatron-core to build the global
it proves a fix on: the fallback is expected there, and the warnings would read as a fault of ours.
torch without numpy (its CPU wheel does not require it) warns on import that it failed to initialise
NumPy: the replay reads no tensor through numpy, so that warning is dropped too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

FRAMEWORK_MODULES = r"(megatron|mindspeed|mindspeed_llm|apex|transformer_engine)(\.|$)"


@contextlib.contextmanager
def framework_warnings_silenced() -> Iterator[None]:
    """UserWarnings raised from the frameworks' own modules, and torch's about a missing numpy, are
    dropped while this lasts (around the imports a replay makes); every other warning is shown as before."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=FRAMEWORK_MODULES)
        warnings.filterwarnings("ignore", category=UserWarning, message="Failed to initialize NumPy")
        yield
