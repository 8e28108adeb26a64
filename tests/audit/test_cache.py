"""The audit's cache: used while nothing the audit read has changed, never otherwise; a corrupt,
foreign or unwritable cache never changes what the audit reports."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROUTER_MODULE
from helpers import run_cli

from unsafe_doctor.adaptor.audit_fixes import plan_fixes_per_holder
from unsafe_doctor.audit import halves
from unsafe_doctor.audit.cache import MAX_ENTRIES
from unsafe_doctor.audit.run import audit
from unsafe_doctor.report import audit as audit_report
from unsafe_doctor.source import looked_at
from unsafe_doctor.source.files import source_bytes

ROOT = Path(__file__).resolve().parents[2]
OLD = 1_000_000_000 * 1_000_000_000  # 2001-09-09 in ns: a time no file of the test is given by writing it


def tree(tmp_path: Path) -> Path:
    """A package of a few modules, one of them holding a device buffer, its files and folders all
    dated OLD: whatever the test changes later gets a later time, however fast the machine."""
    package = tmp_path / "src" / "pkg"
    package.mkdir(parents=True)
    files = {"__init__.py": "", "router.py": ROUTER_MODULE, **{f"plain_{number}.py": "X = 1\n" for number in range(6)}}
    for name, text in files.items():
        (package / name).write_text(text)
    for path in [*package.iterdir(), package, package.parent]:
        os.utime(path, ns=(OLD, OLD))
    return package


def written(path: Path, text: str) -> None:
    """The file written, and its folder dated OLD again: only the file's bytes differ."""
    folder_time = path.parent.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path.parent, ns=(folder_time, folder_time))


def report(result) -> str:
    return audit_report.audit_json(result)


def names(result) -> set[str]:
    return {item.holder.name.dotted for item in result.holders}


def test_the_same_audit_again_comes_from_the_cache_with_the_same_report(tmp_path):
    package = tree(tmp_path)
    first = audit([package], cache=tmp_path / "cache")
    assert [path.name[:6] for path in (tmp_path / "cache").iterdir()] == ["audit-"]  # no temporary file left
    again = audit([package], cache=tmp_path / "cache")
    assert (first.cache.use, again.cache.use) == ("stored", "hit")
    assert report(again) == report(first) == report(audit([package]))
    assert "pkg.router.Router.counts" in names(again)


def test_a_cache_folder_inside_the_audited_tree_is_not_a_change(tmp_path):
    """`--cache-dir` beside the project: made before the audit reads its folder, never watched."""
    source = tree(tmp_path).parent
    assert audit([source], cache=source / "cache").cache.use == "stored"
    assert audit([source], cache=source / "cache").cache.use == "hit"


def test_no_cache_folder_keeps_nothing(tmp_path):
    package = tree(tmp_path)
    assert audit([package]).cache.use == "off"
    assert audit([package]).cache.use == "off"


def test_a_file_whose_bytes_changed_is_audited_again(tmp_path):
    package = tree(tmp_path)
    audit([package], cache=tmp_path / "cache")
    router = package / "router.py"
    status = router.stat()
    written(router, ROUTER_MODULE.replace('"counts"', '"totals"').replace("self.counts", "self.totals"))
    os.utime(router, ns=(status.st_atime_ns, status.st_mtime_ns))  # the same time: only the bytes tell
    again = audit([package], cache=tmp_path / "cache")
    assert again.cache.use == "stored"
    assert "pkg.router.Router.totals" in names(again) and "pkg.router.Router.counts" not in names(again)


def test_a_module_added_to_the_tree_is_audited(tmp_path):
    package = tree(tmp_path)
    audit([package], cache=tmp_path / "cache")
    (package / "later.py").write_text(ROUTER_MODULE.replace("class Router", "class Later"))
    again = audit([package], cache=tmp_path / "cache")
    assert again.cache.use == "stored"
    assert "pkg.later.Later.counts" in names(again)


def test_an_edited_adaptor_outside_the_tree_is_read_again(tmp_path):
    """The adaptor is read, not audited: an edit of it (as `--fix` makes) is seen all the same."""
    package = tree(tmp_path)
    adaptor = tmp_path / "adaptor" / "recovery.py"  # its folder is watched: not the cache's
    adaptor.parent.mkdir()
    adaptor.write_text((ROOT / "samples" / "framework" / "toytrain" / "recovery.py").read_text())
    first = audit([package], adaptor=adaptor, cache=tmp_path / "cache")
    assert audit([package], adaptor=adaptor, cache=tmp_path / "cache").cache.use == "hit"
    adaptor.write_text(adaptor.read_text() + "\n# edited\n")
    again = audit([package], adaptor=adaptor, cache=tmp_path / "cache")
    assert again.cache.use == "stored" and report(again) == report(first)


def test_what_the_forked_copy_reads_is_recorded_here(tmp_path):
    """`shared_out`'s copy sends back what it read: its reads count as this process's."""
    if not halves._two_cores():
        pytest.skip("one core: no copy is forked")

    def work(worker):
        looked_at.note_read(tmp_path / ("copy.py" if worker.copy else "parent.py"), b"x = 1\n")
        return [item for item in range(4) if worker.claim(item)]

    with looked_at.recording() as looked:
        shares = halves.shared_out(4, work, lambda done: None)
    assert len(shares) == 2
    assert {str(tmp_path / "copy.py"), str(tmp_path / "parent.py")} <= set(looked.files)


def test_a_file_two_processes_read_differently_leaves_the_record_incomplete():
    """Changed while the run read it: the entry would hold bytes the audit did not see."""
    here, there = looked_at.LookedAt(files={"/a.py": b"1"}), looked_at.LookedAt(files={"/a.py": b"2", "/b.py": b"3"})
    here.merge(there)
    assert not here.complete and here.files == {"/a.py": b"1", "/b.py": b"3"}


def test_a_path_entry_made_after_the_audit_is_a_change(tmp_path, monkeypatch):
    package = tree(tmp_path)
    later = tmp_path / "site" / "later"
    monkeypatch.syspath_prepend(str(later))
    audit([package], cache=tmp_path / "cache")
    assert audit([package], cache=tmp_path / "cache").cache.use == "hit"
    later.mkdir(parents=True)
    assert audit([package], cache=tmp_path / "cache").cache.use == "stored"


def test_an_init_added_above_the_import_root_renames_the_modules(tmp_path):
    package = tree(tmp_path)
    first = audit([package], cache=tmp_path / "cache")
    (tmp_path / "src" / "__init__.py").write_text("")
    again = audit([package], cache=tmp_path / "cache")
    assert again.cache.use == "stored" and names(again) != names(first)
    assert report(again) == report(audit([package]))


def test_a_module_added_under_the_adaptors_import_root_is_a_change(tmp_path):
    """Names lead into the adaptor's import root first: a module added there is watched."""
    package = tree(tmp_path)
    adaptor = tmp_path / "job" / "recovery.py"
    adaptor.parent.mkdir()
    adaptor.write_text((ROOT / "samples" / "framework" / "toytrain" / "recovery.py").read_text())
    audit([package], adaptor=adaptor, cache=tmp_path / "cache")
    assert audit([package], adaptor=adaptor, cache=tmp_path / "cache").cache.use == "hit"
    (tmp_path / "job" / "megatron").mkdir()
    assert audit([package], adaptor=adaptor, cache=tmp_path / "cache").cache.use == "stored"


def test_a_link_pointed_at_another_file_with_the_same_bytes_is_a_change(tmp_path):
    package = tree(tmp_path)
    (tmp_path / "a.py").write_text(ROUTER_MODULE)
    (tmp_path / "b.py").write_text(ROUTER_MODULE)
    (package / "linked.py").symlink_to(tmp_path / "a.py")
    audit([package], cache=tmp_path / "cache")
    (package / "linked.py").unlink()
    (package / "linked.py").symlink_to(tmp_path / "b.py")
    assert audit([package], cache=tmp_path / "cache").cache.use == "stored"


def test_a_file_read_whole_is_checked_whole(tmp_path):
    big = tmp_path / "big.py"
    big.write_bytes(b"x" * 100)
    with looked_at.recording() as looked:
        looked_at.note_read(big, big.read_bytes(), whole=True)
    assert looked.unchanged(source_bytes)
    big.write_bytes(b"y" * 100)
    assert not looked.unchanged(source_bytes)


def test_a_changed_rule_file_is_another_audit(tmp_path):
    package = tree(tmp_path)
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules: []\n")
    audit([package], rule_paths=[rules], cache=tmp_path / "cache")
    assert audit([package], rule_paths=[rules], cache=tmp_path / "cache").cache.use == "hit"
    rules.write_text("rules: []\n# edited\n")
    assert audit([package], rule_paths=[rules], cache=tmp_path / "cache").cache.use == "stored"


def test_a_corrupt_entry_is_a_miss_and_is_replaced(tmp_path):
    package = tree(tmp_path)
    expected = report(audit([package], cache=tmp_path / "cache"))
    (entry,) = (tmp_path / "cache").glob("audit-*.pickle")
    entry.write_bytes(entry.read_bytes()[:100])
    again = audit([package], cache=tmp_path / "cache")
    assert again.cache.use == "stored" and report(again) == expected
    assert audit([package], cache=tmp_path / "cache").cache.use == "hit"


def test_an_entry_others_may_write_is_never_read(tmp_path):
    package = tree(tmp_path)
    audit([package], cache=tmp_path / "cache")
    (entry,) = (tmp_path / "cache").glob("audit-*.pickle")
    entry.chmod(0o666)
    assert audit([package], cache=tmp_path / "cache").cache.use == "stored"


def test_an_unwritable_cache_says_why_and_changes_nothing_else(tmp_path):
    package = tree(tmp_path)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    result = audit([package], cache=blocked / "cache")  # a folder under a file: refused even to root
    assert result.cache.use == "not stored" and str(blocked) in result.cache.why
    assert report(result) == report(audit([package]))


def test_a_cache_folder_others_may_write_is_never_read(tmp_path):
    package = tree(tmp_path)
    audit([package], cache=tmp_path / "cache")
    (tmp_path / "cache").chmod(0o777)
    assert audit([package], cache=tmp_path / "cache").cache.use == "stored"


def test_a_temporary_file_a_killed_audit_left_is_removed_an_hour_later(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".entry-old.tmp").write_bytes(b"")
    os.utime(cache / ".entry-old.tmp", ns=(OLD, OLD))
    (cache / ".entry-new.tmp").write_bytes(b"")  # another audit's, being written
    audit([tree(tmp_path)], cache=cache)
    assert not (cache / ".entry-old.tmp").exists() and (cache / ".entry-new.tmp").exists()


def test_only_the_latest_entries_are_kept(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    for number in range(MAX_ENTRIES + 3):
        stale = cache / f"audit-{number:064x}.pickle"
        stale.write_bytes(b"")
        os.utime(stale, ns=(OLD + number, OLD + number))
    audit([tree(tmp_path)], cache=cache)
    kept = sorted(path.name for path in cache.glob("audit-*.pickle"))
    assert len(kept) == MAX_ENTRIES and f"audit-{0:064x}.pickle" not in kept


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`unsafe-doctor audit ARGS` in this process, at 120 columns, with no UNSAFE_DOCTOR_* setting from
    the environment (the tests name the cache folder, or --no-cache)."""
    return run_cli("audit", *args, cwd=cwd, env={"COLUMNS": "120"}, unset=("UNSAFE_DOCTOR_", "_UNSAFE_DOCTOR"))


def cli_in_a_process(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The audit as `python -m unsafe_doctor` runs it: `cwd` first on its sys.path, which an entry's key holds."""
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", "audit", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env={"COLUMNS": "120", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )


def test_the_command_says_when_the_report_came_from_the_cache(tmp_path):
    """Run from the tree's import root (`python -m` puts it on sys.path), the cache kept elsewhere."""
    tree(tmp_path)
    cache = str(tmp_path / "cache")
    first = cli_in_a_process("pkg", "--cache-dir", cache, cwd=tmp_path / "src")
    again = cli_in_a_process("pkg", "--cache-dir", cache, cwd=tmp_path / "src")
    assert first.returncode == again.returncode == 1, first.stderr
    assert "from the cache" not in first.stdout
    assert "from the cache" in again.stdout
    assert (
        cli_in_a_process("pkg", "--cache-dir", cache, "--format", "json", cwd=tmp_path / "src").stdout
        == cli_in_a_process("pkg", "--no-cache", "--format", "json", cwd=tmp_path / "src").stdout
    )


def test_an_adaptor_that_is_a_link_loop_is_one_line_and_exit_2(tmp_path):
    tree(tmp_path)
    (tmp_path / "src" / "self.py").symlink_to("self.py")
    result = cli("pkg", "--adaptor", "self.py", "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path / "src")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "self.py" in result.stderr


def test_no_cache_writes_no_entry(tmp_path):
    tree(tmp_path)
    assert cli("pkg", "--cache-dir", str(tmp_path / "cache"), "--no-cache", cwd=tmp_path / "src").returncode == 1
    assert not (tmp_path / "cache").exists()


def test_an_unwritable_cache_is_one_note_on_stderr(tmp_path):
    tree(tmp_path)
    (tmp_path / "a-file").write_text("")
    result = cli("pkg", "--cache-dir", str(tmp_path / "a-file" / "cache"), "--format", "json", cwd=tmp_path / "src")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if "cache" in line] == [
        f"unsafe-doctor: the audit was not cached: {tmp_path / 'a-file' / 'cache'}: not a directory"
    ]


def test_two_audits_at_once_leave_one_whole_entry(tmp_path):
    tree(tmp_path)
    cache = str(tmp_path / "cache")
    command = [sys.executable, "-m", "unsafe_doctor", "audit", "pkg", "--cache-dir", cache, "--format", "json"]
    environment = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    both = [subprocess.Popen(command, cwd=tmp_path / "src", env=environment, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=120)[0] for process in both]
    assert outputs[0] == outputs[1]
    assert [path.name[:6] for path in (tmp_path / "cache").iterdir()] == ["audit-"]  # one, no temporary file
    again = cli_in_a_process("pkg", "--cache-dir", cache, "--format", "json", cwd=tmp_path / "src")
    assert again.stdout == outputs[0]
    assert "from the cache" in cli_in_a_process("pkg", "--cache-dir", cache, cwd=tmp_path / "src").stdout


@pytest.mark.parametrize("flag", ["--no-cache", "--cache-dir"])
def test_the_cache_options_are_in_the_help(flag):
    help_text = run_cli("audit", "--help", env={"COLUMNS": "200"}).stdout
    assert flag in help_text


def test_an_adaptor_picked_at_the_terminal_is_not_kept(tmp_path):
    """Two adaptors under the paths: the person's pick is not part of what an entry matches."""
    package = tree(tmp_path)
    adaptor = (ROOT / "samples" / "framework" / "toytrain" / "recovery.py").read_text()
    for name in ("recovery_a.py", "recovery_b.py"):
        (package / name).write_text(adaptor)
    picked: list[Path] = []

    def pick(error):
        picked.append(error.candidates[0])
        return error.candidates[0]

    result = audit([package], cache=tmp_path / "cache", choose_adaptor=pick)
    if not picked:
        pytest.skip("these two files were not both taken for adaptors")
    assert result.cache.use == "not stored" and "chosen at the terminal" in result.cache.why
    assert not list((tmp_path / "cache").glob("audit-*.pickle"))


def test_the_real_megatron_core_audit_is_the_same_from_the_cache(tmp_path):
    """The installed megatron-core 0.16.1 (366 files) with the legacy adaptor: the JSON and the SARIF
    with its fixes, every byte, from the cache as from the audit."""
    spec = importlib.util.find_spec("megatron.core")
    assert spec is not None and spec.submodule_search_locations, "megatron-core 0.16.1 is a test dependency"
    core = Path(next(iter(spec.submodule_search_locations)))
    adaptor = ROOT / "samples" / "adaptors" / "legacy" / "mindio_ttp" / "adaptor" / "modellink_adaptor.py"
    first = audit([core], adaptor=adaptor, cache=tmp_path / "cache")
    again = audit([core], adaptor=adaptor, cache=tmp_path / "cache")
    assert again.cache.use == "hit" and report(again) == report(first)
    sarif = audit_report.audit_sarif
    assert sarif(again, plan_fixes_per_holder(again)) == sarif(first, plan_fixes_per_holder(first))
