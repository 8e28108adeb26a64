"""How unsafe-doctor reads Python source: on disk, parsed with `ast`, never imported.

Importing the user's or a framework's code would import torch and run module-level code, so every
stage reads source through this package:

* `files`: which files are internal (torch, the standard library), which Python files a folder
  holds (one skip policy), the framework packages, import roots and dotted module names.
* `syntax`: small helpers over `ast` nodes: statements of a block, a module's functions and what
  encloses each, what a function returns, bindings, decorators, values.
* `workspace`: a printed path -> the local file and its module; a module -> its file; each file
  read and parsed once, with its module-level bindings typed.
* `printed`: a traceback's printed source line parsed on its own, and its 3.11+ position markers
  placed on parsed code: the operands that raised.
* `resolve`: the one place that answers "which global does this expression mean".
* `imports`, `index`, `fingerprint`, `skeleton`: a file's imports; the shipped index of framework
  releases (names, lines, hashes, skeletons), and what tells one release from another.
* `markers`: the comments that mark the blocks unsafe-doctor wrote into a file.
* `looked_at`: what a run read of the file system (files' bytes, folders' entries), recorded while
  the audit's cache needs it.

Imports `errors` and `log` (`log.inputs` reads the user's paths): nothing that knows rules.
"""
