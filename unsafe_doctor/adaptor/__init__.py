"""The user's recovery adaptor, read and edited: its `code` (files, functions, where a block goes, the
blocks already written), the resets it already does (`existing_reset`), the fix planned from a
classification (`plan`; its code rendered by `knowledge.render`), spliced into the file by lines
(`splice`) and written with a backup (`write`), what `--function` and `--parameter` name
(`overrides`), the fixes for an audit's holders (`audit_fixes`), and the sentinel's call
(`sentinel_install`).

Imports `errors`, `log`, `source`, `knowledge` and `audit` (what the adaptor covers).
"""
