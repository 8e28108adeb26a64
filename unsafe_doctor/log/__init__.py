"""Reading a failure log: the inputs (stdin, files, folders, .gz; any size, in bounded memory),
their lines (rank prefixes, clean text), the Python tracebacks in them, the recovery context
(MindIO's phases, fault ranks, steps), the format of the sentinel's log lines, which the
sentinel writes and diagnose reads, and the name of a global they carry (`GlobalName`), which every
stage above holds.

Imports only `errors`: never torch, never the source model.
"""
