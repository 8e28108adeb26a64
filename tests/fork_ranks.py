"""Run one script as every rank of a world: `python fork_ranks.py SCRIPT WORLD FOLDER` (tests/helpers.py).

torch is imported once, then each rank is forked with RANK set and runs SCRIPT as `python SCRIPT`
would (its folder first on sys.path, its own argv, as __main__, exit handlers at the end), with its
stdout and stderr in FOLDER/<rank>.out and FOLDER/<rank>.err. Prints each rank's exit code, by rank.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import traceback

import torch  # noqa: F401  (once, before the fork, for every rank)


def rank_main(script: str, rank: int, folder: str) -> None:
    os.environ["RANK"] = str(rank)
    for descriptor, suffix in ((1, "out"), (2, "err")):
        os.dup2(os.open(os.path.join(folder, f"{rank}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), descriptor)
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (printed, as Python prints what ends a script)
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    script, world, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ranks = {}
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            rank_main(script, rank, folder)
        ranks[pid] = rank
    codes = {}
    while ranks:
        pid, status = os.wait()
        codes[ranks.pop(pid)] = os.waitstatus_to_exitcode(status)
    print(json.dumps(codes))


if __name__ == "__main__":
    main()
