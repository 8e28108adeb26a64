"""Results -> JSON (versioned contracts), SARIF, or rich renderables for a terminal.

One module per output: `diagnosis` (its JSON and SARIF; `diagnosis_text` its terminal's), `fix` (a
plan and what was written), `verification`, `audit`, `rules`; `sarif` holds the envelope and
locations that diagnosis and audit share, `common` the pieces several outputs show alike, `terminal`
those the terminal's reports draw alike. rich loads only with the modules that render for a
terminal: a JSON or SARIF diagnosis loads none of it. Nothing here prints: the CLI decides where the
output goes.

Reads the results of every stage below it; only `cli` imports it.
"""
