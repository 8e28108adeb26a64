"""`unsafe-doctor fix` under attack: what it writes, where, as whom, and what it refuses.

Each test is one attack, run for real: the command in a subprocess on files in
tmp_path (a planted symlink, a full tmpfs, a file owned by another user, hand-broken markers, a
patch fed to `git apply` and `patch`, a log whose module shadows a name the block needs, a cp932
adaptor, stdout on /dev/full).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import refused, warm_python

from unsafe_doctor.adaptor.write import BACKUP_SUFFIX
from unsafe_doctor.knowledge.rules import is_safe_dotted

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORK = ROOT / "samples" / "framework"
EMA_LOG = ROOT / "samples" / "logs" / "toytrain_ema"
ORIGINAL = (FRAMEWORK / "toytrain" / "recovery.py").read_bytes()
BEGIN, END = "# unsafe-doctor: begin ", "# unsafe-doctor: end "


def run(*args: str, cwd: Path = ROOT, stdout=subprocess.PIPE, **options) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", "fix", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=environment,
        timeout=120,
        stdin=subprocess.DEVNULL,
        **options,
    )


def adaptor_in(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    adaptor = folder / "recovery.py"
    adaptor.write_bytes(ORIGINAL)
    return adaptor


def fix_ema(adaptor: Path, *extra: str, cwd: Path = ROOT, **options) -> subprocess.CompletedProcess:
    return run(str(EMA_LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), *extra, cwd=cwd, **options)


def backup(adaptor: Path) -> Path:
    return adaptor.with_name(adaptor.name + BACKUP_SUFFIX)


# --- backups ----------------------------------------------------------------------------------------


def test_a_symlink_planted_at_the_backup_name_is_not_followed(tmp_path):
    adaptor = adaptor_in(tmp_path / "job")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    victim.chmod(0o600)
    backup(adaptor).symlink_to(victim)

    result = fix_ema(adaptor, "--yes")

    assert result.returncode == 0, result.stderr
    assert victim.read_bytes() == b"precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not backup(adaptor).is_symlink() and backup(adaptor).read_bytes() == ORIGINAL  # the link replaced, not followed
    assert f"wrote {adaptor} (backup: {backup(adaptor)})" in result.stderr


def test_fix_revert_install_revert_leave_one_backup_the_file_before_the_last_write(tmp_path):
    """Four writes once left four backups beside the adaptor, untracked in the user's git tree."""
    adaptor = adaptor_in(tmp_path)
    sentinel = [sys.executable, "-m", "unsafe_doctor", "sentinel", "install", "--adaptor", str(adaptor), "--yes"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert fix_ema(adaptor, "--yes").returncode == 0
    assert run("--revert", "--adaptor", str(adaptor), "--yes").returncode == 0
    installed = subprocess.run(sentinel, capture_output=True, text=True, env=environment, timeout=120)
    assert installed.returncode == 0, installed.stderr
    with_sentinel = adaptor.read_bytes()
    reverted = subprocess.run([*sentinel, "--revert"], capture_output=True, text=True, env=environment, timeout=120)
    assert reverted.returncode == 0, reverted.stderr

    assert sorted(path.name for path in tmp_path.iterdir()) == ["recovery.py", "recovery.py" + BACKUP_SUFFIX]
    assert backup(adaptor).read_bytes() == with_sentinel  # what the last write replaced
    assert adaptor.read_bytes() == ORIGINAL
    assert f"(backup: {backup(adaptor)})" in reverted.stderr


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 64 KiB tmpfs (the tests run as root, as in CI); elsewhere a file-size limit stands in."""
    folder = tmp_path / "small"
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    mounted = mount.returncode == 0
    yield folder, mounted
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


def limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def fill(folder: Path, leave: int) -> None:
    """Take the tmpfs's pages until `leave` bytes are free."""
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize - leave
    with open(folder / "filler", "wb", buffering=0) as filler:
        try:
            filler.write(b"\0" * free)
        except OSError:
            pass


def test_a_full_disk_while_writing_the_backup_leaves_the_old_backup_and_the_adaptor_whole(full_tmpfs):
    folder, mounted = full_tmpfs
    adaptor = adaptor_in(folder)
    old_backup = b"the user's original, from the first fix\n" * 40
    backup(adaptor).write_bytes(old_backup)
    options = {"preexec_fn": limit_file_size} if not mounted else {}
    if mounted:
        fill(folder, leave=0)
    before = sorted(path.name for path in folder.iterdir())

    result = fix_ema(adaptor, "--yes", **options)

    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"unsafe-doctor: cannot write {adaptor}: ")  # after the plan's lines
    assert result.stderr.endswith(": nothing written\n")
    assert adaptor.read_bytes() == ORIGINAL
    assert backup(adaptor).read_bytes() == old_backup
    assert sorted(path.name for path in folder.iterdir()) == before  # no temporary file left behind


STAGE_TWO_FILES = """\
import hashlib, sys
from pathlib import Path
from unsafe_doctor.errors import UsageError
from unsafe_doctor.adaptor.plan import Plan
from unsafe_doctor.adaptor.splice import FileEdit
from unsafe_doctor.adaptor.write import apply
edits = []
for name, grown in (("first.py", 10), ("second.py", 20000)):
    original = Path(name).read_bytes()
    updated = original + b"#" * grown + b"\\n"
    edits.append(FileEdit(Path(name), original, updated, "utf-8", hashlib.sha256(original).hexdigest(), ()))
try:
    apply(Plan(tuple(edits), (), (), ()))
except UsageError as error:
    sys.exit(str(error))
"""


def test_a_disk_that_fills_on_the_second_file_leaves_the_first_unwritten_too(full_tmpfs):
    folder, mounted = full_tmpfs
    for name in ("first.py", "second.py"):
        (folder / name).write_bytes(b"x = 1\n")
    if mounted:
        fill(folder, leave=12 << 10)  # room for the first file's backup and content and the second's backup
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", STAGE_TWO_FILES],
        capture_output=True,
        text=True,
        cwd=folder,
        env=environment,
        timeout=120,
        preexec_fn=None if mounted else limit_file_size,
    )
    assert result.returncode == 1 and result.stderr.startswith("cannot write second.py: "), result.stderr
    assert result.stderr.endswith(": nothing written\n")
    assert (folder / "first.py").read_bytes() == (folder / "second.py").read_bytes() == b"x = 1\n"
    assert sorted(path.name for path in folder.iterdir()) == ["filler", "first.py", "second.py"][not mounted :]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_root_fixing_another_users_file_keeps_its_owner_group_and_mode(tmp_path):
    adaptor = adaptor_in(tmp_path)
    os.chown(adaptor, 12345, 23456)
    adaptor.chmod(0o640)

    result = fix_ema(adaptor, "--yes")

    assert result.returncode == 0, result.stderr
    for path in (adaptor, backup(adaptor)):
        status = path.stat()
        assert (status.st_uid, status.st_gid, stat.S_IMODE(status.st_mode)) == (12345, 23456, 0o640), path
    assert adaptor.read_bytes() != ORIGINAL


# --- revert with broken markers -----------------------------------------------------------------------


def broken(adaptor: Path, how: str) -> int:
    """The patched adaptor with its markers broken `how`; the 1-based line the refusal must name."""
    lines = adaptor.read_text().splitlines(keepends=True)
    begins = [index for index, line in enumerate(lines) if line.strip().startswith(BEGIN)]
    ends = [index for index, line in enumerate(lines) if line.strip().startswith(END)]
    if how == "first end lost":  # a merge dropped it: the first begin must not pair with the second end
        del lines[ends[0]]
        line = begins[1]
    elif how == "last end lost":
        del lines[ends[1]]
        line = begins[1] + 1
    elif how == "begin lost":
        del lines[begins[0]]
        line = ends[0]  # one line up once the begin is gone
    elif how == "nested":  # the second block moved inside the first
        block = lines[begins[1] : ends[1] + 1]
        del lines[begins[1] : ends[1] + 1]
        lines[ends[0] : ends[0]] = block
        line = ends[0] + 1
    elif how == "send end and recv begin lost":  # the same key on both sides: the two left pair up across a def
        del lines[begins[1]]
        del lines[ends[0]]
        line = begins[0] + 1
    else:  # interleaved: the first block's end moved after the second block's begin
        lines.insert(begins[1], lines.pop(ends[0]))
        line = begins[1]
    adaptor.write_text("".join(lines))
    return line


@pytest.mark.parametrize(
    "how", ["first end lost", "last end lost", "begin lost", "nested", "interleaved", "send end and recv begin lost"]
)
def test_revert_refuses_markers_out_of_place_and_changes_nothing(tmp_path, how):
    adaptor = adaptor_in(tmp_path)
    assert fix_ema(adaptor, "--yes").returncode == 0
    line = broken(adaptor, how)
    before = sorted(tmp_path.iterdir()), adaptor.read_bytes()

    result = run("--revert", "--adaptor", str(adaptor), "--yes")

    refused(result, f"{adaptor}:{line}: ")
    assert "mend the markers by hand" in result.stderr
    assert (sorted(tmp_path.iterdir()), adaptor.read_bytes()) == before


def test_markers_paired_across_a_function_boundary_are_refused_by_every_command_that_pairs_them(tmp_path):
    """The send block's end and the receive block's begin of one key lost: the begin left in
    send_rank_repair() and the end left in recv_rank_repair() must not make one block, which would
    take recv_rank_repair() out whole (the file still compiles)."""
    adaptor = adaptor_in(tmp_path)
    assert fix_ema(adaptor, "--yes").returncode == 0
    line = broken(adaptor, "send end and recv begin lost")
    text = adaptor.read_text().splitlines()
    end = next(index for index, row in enumerate(text) if row.strip().startswith(END)) + 1
    recv = next(index for index, row in enumerate(text) if row.startswith("def recv_rank_repair(")) + 1
    before = sorted(tmp_path.iterdir()), adaptor.read_bytes()

    for result in (
        run("--revert", "--adaptor", str(adaptor), "--yes"),
        fix_ema(adaptor, "--yes"),
        sentinel("install", "--adaptor", str(adaptor), "--yes"),
        sentinel("install", "--revert", "--adaptor", str(adaptor), "--yes"),
    ):
        refused(
            result,
            f"{adaptor}:{line}: block generic.replica-copy:toytrain.state._EMA_GRAD_NORM "
            f"(lines {line}-{end}) runs across the boundary of recv_rank_repair() (line {recv})",
        )
        assert (sorted(tmp_path.iterdir()), adaptor.read_bytes()) == before


def sentinel(*args: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "unsafe_doctor", "sentinel", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


# --- the dry run's patch -------------------------------------------------------------------------------


def applies(patch: str, *, git_in: Path, patch_in: Path) -> None:
    for command, folder in ((["git", "apply", "--check", "-"], git_in), (["patch", "-p1", "--dry-run"], patch_in)):
        result = subprocess.run(command, input=patch, capture_output=True, text=True, cwd=folder)
        assert result.returncode == 0, f"{command} in {folder}: {result.stdout}{result.stderr}"


def test_the_dry_run_patch_applies_with_git_apply_and_patch_p1(tmp_path):
    adaptor = adaptor_in(tmp_path / "job" / "toytrain")
    for given in (str(adaptor), "job/toytrain/recovery.py"):
        result = fix_ema(Path(given), "--dry-run", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("--- a/job/toytrain/recovery.py\n+++ b/job/toytrain/recovery.py\n")
        applies(result.stdout, git_in=tmp_path, patch_in=tmp_path)
    assert adaptor.read_bytes() == ORIGINAL


def test_inside_a_git_repository_the_patch_names_files_from_its_root(tmp_path):
    repository = tmp_path / "repo"
    adaptor = adaptor_in(repository / "toytrain")
    subprocess.run(["git", "init", "-q", str(repository)], check=True)

    result = fix_ema(Path("recovery.py"), "--dry-run", cwd=adaptor.parent)

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("--- a/toytrain/recovery.py\n+++ b/toytrain/recovery.py\n")
    applies(result.stdout, git_in=adaptor.parent, patch_in=repository)


# --- generated code that shadows ---------------------------------------------------------------------

RULE = """\
rules:
  - id: team.buffer
    title: Re-initialise the team's step buffer
    match: {variable: _TEAM_BUFFER}
    scenario: 1
    phase: rollback
    fix:
      imports:
        - import torch
        - from $parent import $alias
      code: |
        value = getattr($alias, "$variable", None)
        if isinstance(value, torch.Tensor):
            value.copy_(torch.zeros(value.shape, dtype=value.dtype, device=value.device))
    reason: The buffer is rebuilt every step.
"""


def team_case(tmp_path: Path, module: str) -> tuple[list[str], Path]:
    """A log failing in team/<module>.py on `_TEAM_BUFFER`, its source, a rule for it, and an adaptor."""
    package = tmp_path / "src" / "team"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    source = "import torch\n_TEAM_BUFFER = torch.zeros(4)\n\n\ndef step():\n    return _TEAM_BUFFER[0] + 1\n"
    (package / f"{module}.py").write_text(source)
    log = tmp_path / "train.log"
    log.write_text(
        "[rank1]: Traceback (most recent call last):\n"
        f'[rank1]:   File "/srv/job/team/{module}.py", line 6, in step\n'
        "[rank1]:     return _TEAM_BUFFER[0] + 1\n"
        "[rank1]: RuntimeError: There is unsafe data in the input tensor.\n"
        "[rank1]: [ERROR] 2025-01-01-00:00:00 (PID:1, Device:1, RankID:1) ERR00003 PTA invalid value\n"
    )
    (tmp_path / "rule.yaml").write_text(RULE)
    adaptor = tmp_path / "adaptor.py"
    adaptor.write_text("def feature_rollback():\n    pass\n")
    args = [str(log), "--rules", str(tmp_path / "rule.yaml"), "--source-root", str(tmp_path / "src"), "--adaptor", str(adaptor)]
    return args, adaptor


@pytest.mark.parametrize("module", ["torch", "value", "dict", "zip", "src_ranks", "repair_group", "state"])
def test_a_module_named_like_a_name_the_block_needs_is_bound_under_another_and_the_block_runs(tmp_path, module):
    """A module called `torch` (another import's name), `value` (the template's local), `dict` or `zip`
    (builtins the generic copies use), `src_ranks` or `repair_group` (names of the roles): the block
    binds it as `team_<name>`, so that no name of the block shadows another; `state` stays `state`."""
    args, adaptor = team_case(tmp_path, module)
    result = run(*args, "--yes")
    assert result.returncode == 0, result.stderr
    text = adaptor.read_text()
    if module == "state":
        assert "    from team import state\n" in text and 'getattr(state, "_TEAM_BUFFER", None)' in text
    else:
        assert f"    from team import {module} as team_{module}\n" in text  # the rule's form, under a free name
        assert f'getattr(team_{module}, "_TEAM_BUFFER", None)' in text
    program = (
        f"import sys, torch\nsys.path.insert(0, {str(tmp_path / 'src')!r})\n"
        + text
        + f"import team.{module}\nteam.{module}._TEAM_BUFFER.fill_(7)\nfeature_rollback()\n"
        f"assert team.{module}._TEAM_BUFFER.tolist() == [0, 0, 0, 0]\n"
    )
    checked = warm_python("import torch").run(program)  # a fresh fork of a Python that loaded torch
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("name", ["_\uff3fbuiltins__", "\uff3f_import__", "p\u0430rallel_state", "mod.\u0455tate", "ｓｔａｔｅ"])
def test_names_that_python_reads_as_other_names_are_not_safe(name):
    assert not is_safe_dotted(name)
    assert is_safe_dotted("megatron.core.parallel_state")


# --- encodings -------------------------------------------------------------------------------------------


def fixed_then_reverted(tmp_path: Path, data: bytes) -> bytes:
    """The adaptor `data` (valid Python) fixed through the CLI, then reverted to the same bytes: what the fix wrote."""
    compile(data, "recovery.py", "exec")
    adaptor = tmp_path / "recovery.py"
    adaptor.write_bytes(data)
    result = fix_ema(adaptor, "--yes")
    assert result.returncode == 0, result.stderr
    patched = adaptor.read_bytes()
    compile(patched, "recovery.py", "exec")
    assert run("--revert", "--adaptor", str(adaptor), "--yes").returncode == 0
    assert adaptor.read_bytes() == data
    return patched


@pytest.mark.parametrize("encoding", ["cp932", "shift_jis"])
def test_a_cp932_adaptor_is_fixed_and_reverted_in_its_own_encoding_and_line_endings(tmp_path, encoding):
    # ソ and 表 end in byte 0x5c (a backslash in ASCII): read as UTF-8 the string's quote is escaped
    text = f"# -*- coding: {encoding} -*-\n# 復旧アダプタ ソ表\n" + ORIGINAL.decode() + "\nMESSAGE = '回復 ソ表 能'\n"
    patched = fixed_then_reverted(tmp_path, text.replace("\n", "\r\n").encode(encoding))
    assert patched.count(b"\r\n") == patched.count(b"\n") and "'回復 ソ表 能'".encode(encoding) in patched


@pytest.mark.parametrize("head", ["# -*- coding: latin-1 -*-\n", "#!/usr/bin/env python\n# coding: latin-1\n"])
def test_an_adaptor_with_cr_only_line_endings_and_a_coding_line_is_fixed_and_reverted_byte_identical(tmp_path, head):
    """Python reads a lone CR as a line end, the coding line's too: the file is valid Python, and its
    block is written with CR endings."""
    text = head + "# adaptateur de reprise, café\n" + ORIGINAL.decode() + "\nMESSAGE = 'déjà'\n"
    patched = fixed_then_reverted(tmp_path, text.replace("\n", "\r").encode("latin-1"))
    assert b"\n" not in patched and f"\r    {BEGIN}generic.replica-copy:".encode() in patched
    assert "'déjà'".encode("latin-1") in patched


# --- the outcome is the write's ---------------------------------------------------------------------------


def test_json_to_a_full_stdout_still_reports_the_write(tmp_path):
    adaptor = adaptor_in(tmp_path)
    with open("/dev/full", "w") as full:
        result = fix_ema(adaptor, "--format", "json", "--yes", stdout=full)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "cannot write the report to standard output: no space left on device" in result.stderr
    assert f"wrote {adaptor} (backup: {backup(adaptor)})" in result.stderr
    assert adaptor.read_bytes() != ORIGINAL and backup(adaptor).read_bytes() == ORIGINAL
    document = json.loads(fix_ema(adaptor, "--format", "json", "--dry-run").stdout)
    assert document["files"] == []  # written: a second run finds every block there


needs_setpriv = pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists(), reason="needs root and setpriv")


def as_user(user: int, group: int, groups: tuple[int, ...], *args: str) -> subprocess.CompletedProcess:
    """`unsafe-doctor fix ARGS` run by another user (setpriv), without root's capabilities."""
    command = [
        "/usr/bin/setpriv",
        f"--reuid={user}",
        f"--regid={group}",
        f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
        "--bounding-set",
        "-all",
        "--inh-caps",
        "-all",
        sys.executable,
        "-m",
        "unsafe_doctor",
        "fix",
        *args,
    ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture
def shared_folder():
    """A folder other users can reach: tmp_path's parents are root's alone."""
    folder = Path(tempfile.mkdtemp(prefix="unsafe-doctor-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


@needs_setpriv
def test_a_sticky_folder_that_refuses_the_rename_is_one_line_and_changes_nothing(tmp_path):
    """A sticky folder owned by another user, holding the file's old backup owned by a third: the
    backup may not be replaced by a rename. Root without its capabilities is such a user."""
    folder = tmp_path / "sticky"
    adaptor = adaptor_in(folder)
    backup(adaptor).write_bytes(b"an old backup\n")
    os.chmod(tmp_path, 0o755)
    os.chmod(folder, 0o1777)
    os.chown(folder, 4343, 4343)
    os.chown(backup(adaptor), 4242, 4242)

    result = as_user(0, 0, (), str(EMA_LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--yes")

    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == f"unsafe-doctor: cannot replace {adaptor}: Operation not permitted: left as it was"
    assert adaptor.read_bytes() == ORIGINAL and backup(adaptor).read_bytes() == b"an old backup\n"
    assert sorted(path.name for path in folder.iterdir()) == ["recovery.py", backup(adaptor).name]  # no temporary file left


@needs_setpriv
def test_a_group_members_fix_leaves_the_adaptor_its_owners_and_keeps_the_backup_in_its_group(shared_folder):
    """Alice's 660 alice:team adaptor in a 775 folder once became bob:bob, file and backup, when
    bob (in team) ran `fix --yes`. Written in place, it stays alice's; the backup keeps the group
    and mode, and the output says it is bob's."""
    alice, bob, team = 4242, 4343, 5000
    folder = shared_folder / "job"
    adaptor = adaptor_in(folder)
    os.chown(folder, alice, team)
    folder.chmod(0o775)
    os.chown(adaptor, alice, team)
    adaptor.chmod(0o660)

    result = as_user(bob, bob, (team,), str(EMA_LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--yes")

    assert result.returncode == 0, result.stderr
    assert adaptor.read_bytes() != ORIGINAL and backup(adaptor).read_bytes() == ORIGINAL
    status = adaptor.stat()
    assert (status.st_uid, status.st_gid, stat.S_IMODE(status.st_mode)) == (alice, team, 0o660)
    status = backup(adaptor).stat()
    assert (status.st_uid, status.st_gid, stat.S_IMODE(status.st_mode)) == (bob, team, 0o660)
    assert "; in place, to keep its owner " in result.stderr
    assert "; warning: the backup belongs to " in result.stderr


def test_a_report_lost_on_a_full_disk_says_what_was_written_and_keeps_the_old_report(tmp_path, full_tmpfs):
    """`fix --yes --format json -o <full disk>` once wrote the adaptor, then said nothing was."""
    folder, mounted = full_tmpfs
    if not mounted:
        pytest.skip("needs a tmpfs to fill (root)")
    report = folder / "fix.json"
    report.write_text("the last report\n")
    fill(folder, leave=0)
    adaptor = adaptor_in(tmp_path / "job")

    result = fix_ema(adaptor, "--yes", "--format", "json", "-o", str(report))

    assert result.returncode == 0, result.stderr
    assert f"cannot write the report to {report}: no space left on device" in result.stderr
    assert f"wrote {adaptor} (backup: {backup(adaptor)})" in result.stderr
    assert adaptor.read_bytes() != ORIGINAL and backup(adaptor).read_bytes() == ORIGINAL
    assert report.read_text() == "the last report\n"
    assert sorted(path.name for path in folder.iterdir()) == ["filler", "fix.json"]


def test_a_fix_keeps_the_adaptors_extended_attributes(tmp_path):
    adaptor = adaptor_in(tmp_path)
    os.setxattr(adaptor, "user.owner-team", b"recovery")
    if os.geteuid() == 0:
        os.setxattr(adaptor, "trusted.label", b"kept")  # as a security label would be

    assert fix_ema(adaptor, "--yes").returncode == 0
    assert adaptor.read_bytes() != ORIGINAL
    assert os.getxattr(adaptor, "user.owner-team") == b"recovery"
    if os.geteuid() == 0:
        assert os.getxattr(adaptor, "trusted.label") == b"kept"


def test_a_hard_linked_adaptor_is_written_in_place_so_every_name_sees_the_fix(tmp_path):
    adaptor = adaptor_in(tmp_path / "job")
    other_name = tmp_path / "vendored_recovery.py"
    os.link(adaptor, other_name)
    inode = adaptor.stat().st_ino

    result = fix_ema(adaptor, "--yes")

    assert result.returncode == 0, result.stderr
    assert "in place, as it has 2 hard links" in result.stderr
    assert adaptor.stat().st_ino == inode and os.path.samefile(adaptor, other_name)
    assert other_name.read_bytes() == adaptor.read_bytes() != ORIGINAL
    assert backup(adaptor).read_bytes() == ORIGINAL
    assert sorted(path.name for path in adaptor.parent.iterdir()) == ["recovery.py", backup(adaptor).name]
