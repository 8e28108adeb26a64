"""The audit's work shared out between two processes (`unsafe_doctor.audit.halves`): a forked
copy claims items on another core, none is done twice, its results come back as if computed here,
and whatever the copy claimed but did not send back is done here; the audit of real MindSpeed and
MindSpeed-LLM files is byte-identical on one core and two."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROUTER_MODULE

from unsafe_doctor.audit.halves import Worker, _Claims, _has_ended, shared_out
from unsafe_doctor.audit.run import _scan_share
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.recovery_code.index import Index, audited_files
from unsafe_doctor.recovery_code.names import Accessors

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
two_cores = pytest.mark.skipif(CORES < 2 or not hasattr(os, "fork"), reason="one core: no copy is forked")


def squares(count: int, value=lambda item: item * item):
    """Work that claims items front to back (the copy back to front) and records who did each."""

    def work(worker: Worker) -> dict[int, tuple[int, int]]:
        done = {}
        for item in reversed(range(count)) if worker.copy else range(count):
            if worker.claim(item):
                done[item] = (value(item), os.getpid())
                worker.tick()
        return done

    return work


def merged(results: list[dict[int, tuple[int, int]]]) -> dict[int, tuple[int, int]]:
    items = [item for result in results for item in result]
    assert len(items) == len(set(items)), "an item was done twice"
    return {item: done for result in results for item, done in result.items()}


def assert_no_child_left():
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


class Rendezvous:
    """This process's first item waits until the copy has done one: whatever the load, the copy
    gets a share (a pipe read blocks; nothing here depends on timing)."""

    def __init__(self):
        self.parent = os.getpid()
        self.read_end, self.write_end = os.pipe()
        self.waited = False

    def copy_did_one(self) -> None:
        os.write(self.write_end, b".")

    def wait_for_the_copy(self) -> None:
        if not self.waited:
            self.waited = True
            os.read(self.read_end, 1)

    def in_the_copy(self) -> bool:
        return os.getpid() != self.parent

    def close(self) -> None:
        os.close(self.read_end)
        os.close(self.write_end)


@two_cores
def test_the_two_processes_share_out_every_item_once_and_the_copys_results_come_back():
    meet = Rendezvous()

    def value(item: int) -> int:
        if meet.in_the_copy():
            meet.copy_did_one()
        else:
            meet.wait_for_the_copy()
        return sum(range(item * 20))

    told: list[int] = []
    try:
        results = shared_out(2000, squares(2000, value), told.append)
    finally:
        meet.close()
    assert len(results) == 2
    done = merged(results)
    assert {item: value for item, (value, _) in done.items()} == {item: sum(range(item * 20)) for item in range(2000)}
    assert {pid for _, pid in results[0].values()} == {os.getpid()}
    assert results[1] and {pid for _, pid in results[1].values()} != {os.getpid()}
    assert told == sorted(set(told)) and told[-1] == 2000  # both processes' items, rising, each count once
    assert_no_child_left()


@two_cores
def test_what_a_failed_copy_claimed_is_done_here():
    meet = Rendezvous()

    def fails_in_the_copy(item: int) -> int:
        if meet.in_the_copy():  # the copy claimed its first item (the last one): it fails on it
            meet.copy_did_one()
            raise MemoryError("the copy ran out of memory")
        meet.wait_for_the_copy()
        return -item

    told: list[int] = []
    try:
        results = shared_out(200, squares(200, fails_in_the_copy), told.append)
    finally:
        meet.close()
    done = merged(results)
    assert {item: value for item, (value, _) in done.items()} == {item: -item for item in range(200)}
    assert {pid for _, pid in done.values()} == {meet.parent}
    assert 199 in results[1], "the item the copy claimed and failed on was redone here"
    assert told[-1] == 200 and told == sorted(told)
    assert_no_child_left()


def test_an_error_of_the_work_reaches_the_caller():
    def broken(worker: Worker) -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        shared_out(3, broken, lambda done: None)
    assert_no_child_left()


def test_an_interrupt_here_leaves_no_copy_behind():
    def interrupted_here(worker: Worker) -> dict[int, tuple[int, int]]:
        if not worker.copy:
            raise KeyboardInterrupt
        return squares(10**6)(worker)

    with pytest.raises(KeyboardInterrupt):
        shared_out(10**6, interrupted_here, lambda done: None)
    assert_no_child_left()


@two_cores
def test_a_copy_killed_holding_the_lock_does_not_hang_this_process():
    claims = _Claims(4)
    pid = os.fork()
    if pid == 0:  # takes the lock, then dies without giving it back
        os.read(claims.lock_read, 1)
        os._exit(9)
    claims.other_gone = lambda: _has_ended(pid)
    try:
        assert claims.claim(2) and not claims.claim(2)
    finally:
        os.waitpid(pid, 0)
        claims.close()


@two_cores
def test_one_core_does_every_item_in_this_process():
    """Limited to one core (as taskset or a container's CPU set limits it), nothing is forked."""
    code = (
        "import os\n"
        "from unsafe_doctor.audit.halves import shared_out\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "def work(worker):\n"
        "    return [os.getpid() for item in range(5) if worker.claim(item)]\n"
        "print(shared_out(5, work, lambda done: None) == [[os.getpid()] * 5])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "True"


def audit_json(paths: list[Path], cores: set[int] | None) -> str:
    """The audit's JSON, run afresh (--no-cache: the cache's key holds no core count, so the second
    run would read the first's report and compare it with itself)."""
    command = [sys.executable, "-m", "unsafe_doctor", "audit", *map(str, paths), "--format", "json", "--no-cache"]
    limited = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    run = subprocess.run(command, capture_output=True, text=True, preexec_fn=limited)
    assert run.returncode in (0, 1), run.stderr
    return run.stdout


@two_cores
def test_the_audit_of_real_code_is_the_same_on_one_core_and_two(real):
    paths = [real / "mindspeed-26.0.0" / "mindspeed", real / "mindspeed-llm-master" / "mindspeed_llm"]
    one_core = audit_json(paths, {min(os.sched_getaffinity(0))})
    assert '"holders"' in one_core
    assert audit_json(paths, None) == one_core


@pytest.mark.parametrize("copy", [False, True], ids=["this-process", "the-copy"])
def test_a_share_that_claims_only_a_file_read_ahead_still_scans_it(tmp_path, copy):
    """A file that registers a buffer is read before the scan (`Index.expect`), and the process that
    claims it when its scan begins scans it, even when the other process took every other file: once,
    under load, such a file was claimed and never scanned, and its buffer was missing from the audit."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "router.py").write_text(ROUTER_MODULE)
    (package / "state.py").write_text("import torch\n\nEMA = torch.zeros(1, device='npu')\n")
    files = audited_files([package])
    index = Index([package], [tmp_path])
    for path in files:
        index.expect(path, tmp_path)
    position = {path: number for number, path in enumerate(files)}
    router = position[package / "router.py"]
    worker = Worker(copy=copy, claim=lambda item: item == router, tick=lambda: None)  # the other process took every other file
    share = _scan_share(worker, files=files, position=position, index=index, accessors=Accessors(index), rules=())
    assert [path.name for path in share.added] == ["router.py"]
    assert GlobalName("pkg.router", "Router", "counts") in share.found.buffers
