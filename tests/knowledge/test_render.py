"""The renderer alone: a fix's code before, the block written into one adaptor function after, as
LibCST's codemod tests hold a transform to its input and output."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from unsafe_doctor.adaptor.code import Adaptor
from unsafe_doctor.errors import UsageError
from unsafe_doctor.knowledge.loading import load_knowledge
from unsafe_doctor.knowledge.render.block import render

LEGACY_ADAPTOR = """\
import torch
import torch.distributed as dist
from mindio_ttp.adaptor.tft_replica_group import get_repair_group


def recv_rank_repair(src_ranks, dest_ranks, optim_idxs, rank_list, train_args):
    repair_group = get_repair_group()
    return True


def send_rank_repair(src_ranks, dest_ranks, optim_idxs, rank_list, train_args):
    return True


def feature_rollback(step, train_args):
    return True
"""

RECV_TENSOR = """\
global_tensor = $TENSOR
if isinstance(global_tensor, torch.Tensor):
    recv_tensor = torch.empty(global_tensor.shape, dtype=global_tensor.dtype, device=global_tensor.device)
    torch.distributed.recv(recv_tensor, src=src_rank, group=get_repair_group())
    global_tensor.copy_(recv_tensor)
"""


def assert_rendered(
    before: str,
    after: str,
    tmp_path: Path,
    *,
    function: str = "recv_rank_repair",
    scenario: int = 2,
    imports: tuple[str, ...] = ("import torch", "from pkg import state"),
    adaptor: str = LEGACY_ADAPTOR,
    profile: str = "mindio-ttp-legacy",
) -> None:
    """The code `before`, rendered into `function` of `adaptor`, is `after` (both dedented)."""
    path = tmp_path / "adaptor.py"
    path.write_text(adaptor)
    code = Adaptor([path])
    role = {"recv_rank_repair": "recv", "send_rank_repair": "send"}.get(function, "rollback")
    site = code.site(code.function(function, role))  # type: ignore[arg-type]
    chosen = load_knowledge().profile(profile)
    assert chosen is not None
    rendered = render(textwrap.dedent(before), imports, scenario, site, chosen, group=None, what="test")
    assert "\n".join(rendered.lines) + "\n" == textwrap.dedent(after)


def test_a_tensor_block_reads_the_files_names_and_loops_once_per_pair(tmp_path):
    assert_rendered(
        RECV_TENSOR.replace("$TENSOR", "state._EMA"),
        """\
        from pkg import state
        for src_rank, _dest_rank in dict.fromkeys(zip(src_ranks, dest_ranks)):  # each pair once, not per optimizer
            global_tensor = state._EMA
            if isinstance(global_tensor, torch.Tensor):
                recv_tensor = torch.empty(global_tensor.shape, dtype=global_tensor.dtype, device=global_tensor.device)
                dist.recv(recv_tensor, src=src_rank, group=repair_group)
                global_tensor.copy_(recv_tensor)
        """,
        tmp_path,
    )


def test_the_send_side_names_the_source_rank_it_does_not_read_as_unused(tmp_path):
    assert_rendered(
        """\
        global_tensor = state._EMA
        if isinstance(global_tensor, torch.Tensor):
            torch.distributed.send(global_tensor, dst=dest_rank, group=get_repair_group())
        """,
        """\
        from pkg import state
        for _src_rank, dest_rank in dict.fromkeys(zip(src_ranks, dest_ranks)):  # each pair once, not per optimizer
            global_tensor = state._EMA
            if isinstance(global_tensor, torch.Tensor):
                dist.send(global_tensor, dst=dest_rank, group=get_repair_group())
        """,
        tmp_path,
        function="send_rank_repair",
    )


def test_a_rules_guard_is_checked_once_outside_the_rank_loop(tmp_path):
    assert_rendered(
        """\
        if getattr(train_args, "moe_router_enable_expert_bias", False):
            torch.distributed.send(state.BIAS, dst=dest_rank, group=get_repair_group())
        """,
        """\
        from pkg import state
        if getattr(train_args, "moe_router_enable_expert_bias", False):
            for _src_rank, dest_rank in dict.fromkeys(zip(src_ranks, dest_ranks)):  # each pair once, not per optimizer
                dist.send(state.BIAS, dst=dest_rank, group=get_repair_group())
        """,
        tmp_path,
        function="send_rank_repair",
    )


def test_a_guard_that_reads_a_rank_stays_inside_the_loop(tmp_path):
    assert_rendered(
        """\
        if src_rank != 0:
            torch.distributed.recv(state.BIAS, src=src_rank, group=get_repair_group())
        """,
        """\
        from pkg import state
        for src_rank, _dest_rank in dict.fromkeys(zip(src_ranks, dest_ranks)):  # each pair once, not per optimizer
            if src_rank != 0:
                dist.recv(state.BIAS, src=src_rank, group=repair_group)
        """,
        tmp_path,
    )


def test_a_guard_with_an_else_stays_inside_the_loop(tmp_path):
    assert_rendered(
        """\
        if state.ON:
            torch.distributed.recv(state.BIAS, src=src_rank, group=get_repair_group())
        else:
            pass
        """,
        """\
        from pkg import state
        for src_rank, _dest_rank in dict.fromkeys(zip(src_ranks, dest_ranks)):  # each pair once, not per optimizer
            if state.ON:
                dist.recv(state.BIAS, src=src_rank, group=repair_group)
            else:
                pass
        """,
        tmp_path,
    )


def test_a_rollback_block_has_no_rank_loop_and_imports_what_the_file_lacks(tmp_path):
    assert_rendered(
        """\
        global_tensor = state._STEPS
        if isinstance(global_tensor, torch.Tensor):
            global_tensor.data.copy_(torch.zeros(global_tensor.shape, dtype=global_tensor.dtype, device=global_tensor.device))
        """,
        """\
        from pkg import state
        global_tensor = state._STEPS
        if isinstance(global_tensor, torch.Tensor):
            global_tensor.data.copy_(torch.zeros(global_tensor.shape, dtype=global_tensor.dtype, device=global_tensor.device))
        """,
        tmp_path,
        function="feature_rollback",
        scenario=1,
    )


def test_a_name_the_function_keeps_is_not_taken_by_the_block(tmp_path):
    adaptor = LEGACY_ADAPTOR.replace(
        "    repair_group = get_repair_group()\n    return True",
        "    repair_group = get_repair_group()\n    global_tensor = 1\n    return global_tensor",
    )
    assert_rendered(
        RECV_TENSOR.replace("$TENSOR", "state._EMA"),
        """\
        from pkg import state
        for src_rank, _dest_rank in dict.fromkeys(zip(src_ranks, dest_ranks)):  # each pair once, not per optimizer
            global_tensor_ = state._EMA
            if isinstance(global_tensor_, torch.Tensor):
                recv_tensor = torch.empty(global_tensor_.shape, dtype=global_tensor_.dtype, device=global_tensor_.device)
                dist.recv(recv_tensor, src=src_rank, group=repair_group)
                global_tensor_.copy_(recv_tensor)
        """,
        tmp_path,
        adaptor=adaptor,
    )


def test_a_file_that_binds_zip_refuses_the_rank_loop(tmp_path):
    with pytest.raises(UsageError, match="binds zip"):
        assert_rendered(RECV_TENSOR.replace("$TENSOR", "state._EMA"), "", tmp_path, adaptor="zip = None\n" + LEGACY_ADAPTOR)
