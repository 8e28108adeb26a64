"""Results -> JSON (versioned contracts), SARIF, or rich renderables for a terminal.

One module per output: `diagnosis`, `fix` (a plan and what was written), `verification`, `audit`,
`rules`; `sarif` holds the envelope and locations that diagnosis and audit share, `common` the
pieces several outputs show alike. Nothing here prints: the CLI decides where the output goes.

Reads the results of every stage below it; only `cli` imports it.
"""
