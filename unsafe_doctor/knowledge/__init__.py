"""What the tool knows about global tensors and recovery adaptors: the rules and adaptor profiles of
`knowledge_base/` (`yaml_file` reads and validates the YAML, `rules` holds them, `matching` matches
them to a frame or a global), the `subject` a rule is about, the classification into scenario 1
or 2 (`classify`: rules first, then the source `heuristics`), the fix's code (`render`: the one
home of code generation), the framework releases found in the job's trees (`versions`), and what
the stages of one command share (`context`).

Imports `errors`, `log` and `source`.
"""
