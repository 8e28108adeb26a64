"""What the adaptor profiles say of real adaptors, held to the real files (../shared/real/MANIFEST.md):
the rules each generation's `resets` lists are those the audit finds its rollback and repair really
reset (the messages that tell a log's generation are held to the real files by test_adaptor_messages.py)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from unsafe_doctor.audit.run import audit
from unsafe_doctor.knowledge.loading import load_knowledge

MINDSPEED = Path("mindspeed-26.0.0", "mindspeed")
ADAPTORS = {  # profile -> the real tree holding its adaptor, under ../shared/real
    "mindspeed-llm-26": Path("mindspeed-llm-master", "mindspeed_llm"),
    "taskd-elastic": Path("mind-cluster-7.2rc1", "taskd"),
}
# megatron-core's module whose globals the adaptors reset by name (the installed release; 0.16.1 in the tests)
PARALLEL_STATE = Path(sysconfig.get_paths()["purelib"], "megatron", "core", "parallel_state.py")


@pytest.mark.parametrize("profile_id", sorted(ADAPTORS))
def test_resets_are_what_the_audit_finds_the_real_adaptor_resets(real, profile_id):
    profile = load_knowledge().profile(profile_id)
    assert profile is not None
    result = audit([PARALLEL_STATE, real / MINDSPEED, real / ADAPTORS[profile_id]])
    assert result.context.environment.profile.id == profile_id
    judged: dict[str, set[str]] = {}
    for item in result.holders:
        rule = item.classification.rule if item.classification else None
        if rule is not None:
            judged.setdefault(rule, set()).add(item.coverage.status)
    assert judged, "the audit found no global a rule names"
    for rule, statuses in judged.items():
        assert (rule in profile.resets) == (statuses == {"covered"}), (rule, statuses)
