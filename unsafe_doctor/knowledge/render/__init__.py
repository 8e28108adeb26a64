"""The one home of code generation: a rule's fix template + a subject + the adaptor profile -> the
block's lines. `template` fills the template with what the subject names (`render_fix` -> `FixPlan`,
or `NoFix` and why); `block` writes that code into one adaptor function, in its own names, between
the block's markers (`render`, `marked_block`). Nothing else builds a fix's code or a marked block
(tests/project/test_layout.py).

It sits in the knowledge stage, below everything that shows or writes a fix, so that the flow stays
one-way: classification decides from the filled template whether a fix can be written at all (a
`NoFix` is part of its verdict), and the filled code is what diagnose's text, JSON and SARIF show
and what the sentinel heals with inside the training process, none of which may load the adaptor's
code. Classify keeping only the template and the slot values, with rendering in the adaptor stage,
would make each of those load it. What `block` reads of an adaptor function is declared here as a
protocol (`block.Place`), which `adaptor.code` fills; the adaptor stage plans, splices and writes.
"""
