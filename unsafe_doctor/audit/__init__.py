"""The audit: every global of a framework that can hold device tensors across training steps, and
whether the recovery adaptor resets, rebuilds or repairs it; found by reading source, before a
fault finds it. Sources are parsed with `ast` (never imported).

**Holders**, the places a tensor can outlive a step:

* *module-global*: a module-level name, or one a function declares `global`;
* *class-attribute*: a name bound in a class body (reached as `Cls.x`, `cls.x`, `self.x`);
* *singleton*: a module global assigned an instance of a class whose methods keep tensors in `self`;
* *registry*: a class-level list or map such instances are added to (`X.append(self)`, `X[k] = C(...)`);
* *lru-cache*: a function or method decorated with `lru_cache` / `cache` that returns a tensor;
* *buffer*: a `register_buffer` of a module class that a method other than `__init__` updates in
  place (`+=`, an in-place method, `.data = ...`, `[k] = ...`).

The audit's own modules (what it reads of source and recovery code is `unsafe_doctor.recovery_code`):

* `holders`: framework code scanned for holders, with their writers and readers;
* `bridge`: classification, through classify and the heuristics (`adaptor.audit_fixes` plans the fixes);
* `halves`: the scan's files and the holders to judge, shared out with a forked copy on a second core;
* `run`: one audit, start to end (it reports a `recovery_code.model.Audit`);
* `cache`: an audit kept whole, used again while nothing it read (`source.looked_at`) has changed.

Imports `errors`, `log`, `source`, `knowledge` and `recovery_code`: the fixer and the CLI build on it,
never the reverse. The package re-exports nothing.
"""
