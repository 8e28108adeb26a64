"""Our stand-in for triton, for the corpus runs of megatron-core 0.18 and newer (generate.py).

Their paged-stash and Mamba kernels decorate functions with triton at import time; no corpus run
calls them. Every decorator (jit, autotune, heuristics) leaves the function as it is. The worker
puts this folder on sys.path only after torch has settled that triton is absent (cases.py).
"""

__version__ = "0.0"


def __getattr__(name):
    return lambda fn=None, *args, **kwargs: fn if callable(fn) else (lambda function: function)
