"""Adaptors whose repair functions take other parameters than the profile's: `--parameter` maps
roles onto them, one peer rank as well as rank lists, and a parameter that holds the repair group."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers import run_cli

from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.rules import map_parameters

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "samples" / "logs" / "toytrain_ema"
FRAMEWORK = ROOT / "samples" / "framework"
HOOKS = """\
def reset_step_state():
    pass


def push_state_to_peer(peer, group):
    pass


def pull_state_from_peer(peer, group):
    pass
"""
FUNCTIONS = "rollback=reset_step_state,send=push_state_to_peer,recv=pull_state_from_peer"


def fix(adaptor: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "fix", str(LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--function", FUNCTIONS, "--yes", *options
    )


def test_one_peer_and_a_group_parameter_are_mapped_onto_the_roles(tmp_path):
    adaptor = tmp_path / "hooks.py"
    adaptor.write_text(HOOKS)
    refused = fix(adaptor)
    assert refused.returncode == 2 and "it has group, peer: name it with --parameter src_ranks=NAME" in refused.stderr
    assert adaptor.read_text() == HOOKS
    result = fix(adaptor, "--parameter", "peer=peer", "--parameter", "group=group")
    assert result.returncode == 0, result.stderr
    written = adaptor.read_text()
    compile(written, str(adaptor), "exec")
    send = written[written.index("def push_state_to_peer") : written.index("def pull_state_from_peer")]
    recv = written[written.index("def pull_state_from_peer") :]
    for side in (send, recv):
        assert "dict.fromkeys(zip(" not in side  # no lists to walk: the one peer is both
        assert "get_repair_group" not in side
    assert "torch.distributed.send(global_tensor, dst=peer, group=group)" in send
    assert "torch.distributed.recv(recv_tensor, src=peer, group=group)" in recv


def test_a_hooks_own_group_parameter_is_used_without_being_named(tmp_path):
    """`push_state_to_peer(peer, group)` with only --parameter peer=peer once got
    MindSpeed-LLM's getter import, in a trainer that has no MindSpeed-LLM. The hook's own group is used."""
    adaptor = tmp_path / "hooks.py"
    adaptor.write_text(HOOKS)
    result = fix(adaptor, "--parameter", "peer=peer")
    assert result.returncode == 0, result.stderr
    written = adaptor.read_text()
    assert "mindspeed_llm" not in written and "get_repair_group" not in written
    assert "torch.distributed.send(global_tensor, dst=peer, group=group)" in written
    assert "push_state_to_peer() takes its repair group as group: the block uses it" in result.stderr
    proven = verify(adaptor, "--parameter", "peer=peer")
    assert proven.returncode == 0, proven.stdout + proven.stderr
    assert "─ PROVEN ·" in proven.stdout  # the hooks' own code (a pass) and their blocks ran whole
    assert "ran the patched adaptor's own pull_state_from_peer(), push_state_to_peer(), reset_step_state()" in " ".join(
        proven.stdout.split()
    )


def test_a_group_parameter_the_function_lacks_is_refused(tmp_path):
    adaptor = tmp_path / "hooks.py"
    adaptor.write_text(HOOKS)
    result = fix(adaptor, "--parameter", "peer=peer,group=pg")
    assert result.returncode == 2 and "has no parameter pg" in result.stderr
    assert adaptor.read_text() == HOOKS


def test_a_profile_file_may_name_a_peer_and_a_group(tmp_path):
    rules = tmp_path / "profile.yaml"
    rules.write_text(
        textwrap.dedent("""\
        profiles:
          - id: in-house-peer
            title: In-house hooks with one peer
            files: [hooks.py]
            rollback: reset_step_state
            send: push_state_to_peer
            recv: pull_state_from_peer
            parameters: {peer: peer, group: group}
            repair_group: {expression: get_repair_group()}
        """)
    )
    [profile] = [item for item in load_knowledge([rules]).profiles if item.id == "in-house-peer"]
    assert profile.parameters == {"src_ranks": ("peer",), "dest_ranks": ("peer",)}
    assert (profile.ranks_are_lists, profile.repair_group, profile.repair_group_imports) == (False, "group", ())


@pytest.mark.parametrize("mapping", [{"rank": ["r"]}, {"peer": ["import"]}, {"train_args": ["a b"]}, {"group": ["g", "h"]}])
def test_unknown_roles_and_names_that_are_not_python_are_refused(mapping):
    profile = load_knowledge([]).profiles[0]
    with pytest.raises(UsageError):
        map_parameters(profile, mapping)


def verify(adaptor: Path, *options: str) -> subprocess.CompletedProcess[str]:
    arguments = [str(LOG), "--source-root", str(FRAMEWORK), "--adaptor", str(adaptor), "--function", FUNCTIONS, "--timeout", "20"]
    return run_cli("verify", *arguments, *options)


def test_verify_proves_a_peer_and_group_fix_given_the_same_parameters(tmp_path):
    adaptor = tmp_path / "hooks.py"
    adaptor.write_text(HOOKS)
    assert fix(adaptor, "--parameter", "peer=peer,group=group").returncode == 0
    refused = verify(adaptor)  # the blocks read `peer`, which the profile does not name
    assert refused.returncode == 2
    assert "reads peer, which no role of adaptor profile" in refused.stderr and "--parameter" in refused.stderr
    proven = verify(adaptor, "--parameter", "peer=peer", "--parameter", "group=group")
    assert proven.returncode == 0, proven.stdout + proven.stderr
    assert "─ PROVEN ·" in proven.stdout and "bit-identical to replica rank" in proven.stdout
