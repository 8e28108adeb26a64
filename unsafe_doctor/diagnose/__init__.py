"""The diagnose pipeline: from a log's tracebacks and sentinel lines to classified findings.
`locate` picks the culprit frame of each unsafe-data traceback and the global tensor its line
read; `sentinel_findings` turns the sentinel's lines into findings; `pipeline` runs the stages over
the inputs and classifies each finding.

Imports `errors`, `npu`, `log`, `source`, `knowledge` and `audit` (the adaptor's stale resets).
"""
