"""What the adaptor profiles say of real adaptors, held to the real files (../shared/real/MANIFEST.md):
the rules each generation's `resets` lists are those the audit finds its rollback and repair really
reset, and the texts its `log_evidence` names are ones its real code logs."""

from __future__ import annotations

import re
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
# Where the texts MindIO's logger writes come from, not the code: the `[PYH file.py:line]` prefix and paths.
NOT_IN_CODE = re.compile(r"\]\[PYH |/")


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


@pytest.mark.parametrize("profile_id", sorted(ADAPTORS))
def test_log_evidence_is_what_the_real_adaptor_logs(real, profile_id):
    profile = load_knowledge().profile(profile_id)
    assert profile is not None
    code = "\n".join(path.read_text() for path in sorted((real / ADAPTORS[profile_id]).rglob("*.py")))
    texts = [text for text in profile.log_evidence if not NOT_IN_CODE.search(text)]
    assert texts
    for text in texts:
        assert text in code, text


def test_the_in_tree_generations_share_their_messages_and_differ_by_one(real):
    """2.3's receive summary names the repair group it built; 26's does not (the texts that tell them apart)."""
    knowledge = load_knowledge()
    older, newer = knowledge.profile("mindspeed-llm-2.3"), knowledge.profile("mindspeed-llm-26")
    assert older is not None and newer is not None
    assert set(newer.log_evidence) < set(older.log_evidence)
    code = (real / ADAPTORS["mindspeed-llm-26"] / "core" / "high_availability" / "tft_optimizer_data_repair.py").read_text()
    assert "recv total time consumed" in code
    assert [text for text in older.log_evidence if text not in newer.log_evidence] == ["s, build repair group:"]
    assert "s, build repair group:" not in code
