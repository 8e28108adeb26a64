"""Replay a fault and its recovery on a real process group, to prove a fix before a restart.

`verify` plans a replay from a diagnosis and the adaptor (`plan`, no torch), `launch` starts the
ranks (forked, or under torchrun through ``python -m unsafe_doctor.replay``), `harness` is one rank,
`probes` build a global's state the framework's way, `results` carry what each rank found, `quiet`
keeps frameworks' import-time warnings off the user's stderr.

Needs torch (the ``replay`` extra); nothing on the log path imports this package. Imports every
stage below it (`npu` to `sentinel`); `__main__` is an entry point (``torchrun -m unsafe_doctor.replay``
runs `verify` through the CLI), not a part of the stage.
"""
