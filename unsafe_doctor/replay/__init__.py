"""Replay a fault and its recovery on a real process group, to prove a fix before a restart.

Needs torch (the ``replay`` extra); nothing on the log path imports this package.
"""
