"""The user's recovery adaptor, read and edited: its `code` (files, functions, where a block goes, the
blocks already written), the resets it already does (`existing_reset`), the fix planned from a
classification and written in the file's own names (`fix`), the fixes for an audit's holders
(`audit_fixes`), and the sentinel's call (`sentinel_install`).

Imports `errors`, `log`, `source`, `knowledge` and `audit` (what the adaptor covers).
"""
