"""Recovery code read against the framework's source, by `ast` (never imported): the library the
audit is built on, and that `diagnose` (stale resets) and `adaptor` (what the adaptor already
resets) use without running an audit.

* `index`: the files and modules read, what each defines, what a dotted name refers to;
* `flow_scope`, `names`, `places`: one scope's names as a walk learns them, what an expression refers
  to (a holder, a function, a class, a module; the holder a small accessor returns), where a tensor lives;
* `uses`, `walk`: the uses a scope's statements make of holders, walked in order (the audit's
  framework scan, `audit.holders`, is one reading of them; `coverage` is the other);
* `coverage`: the adaptor's rollback, send and receive functions judged for each holder;
* `stale`: the adaptor's existing resets that name a global the framework no longer has;
* `model`: holders, sites, coverage and the whole audit as reported; `refs`: the keys of holders,
  classes and functions; `vocabulary`: the methods and calls the walk knows.

Imports `errors`, `log`, `source` and `knowledge`. It re-exports nothing: diagnose reads `stale`
alone, without the walk's modules.
"""
