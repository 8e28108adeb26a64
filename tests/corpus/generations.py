"""The recovery adaptor generations a corpus run can show: what each logs, and how, and whether it
rebuilds the faulty rank's model and optimizer. `worker.py` reads `EMULATED_ADAPTOR_GENERATION`.

Message texts are the generations' own (README.md, "Adaptor generations", has the sources); the
code around them is the worker's. Two ways of logging:

- MindSpeed-LLM's in-tree adaptor (2.3.0, 26.x) uses Python `logging.getLogger(__name__)`: its
  lines carry the module's name, `mindspeed_llm.core.high_availability.tft_stop_clean` and so on,
  in the format the job configured (the worker's `basicConfig`);
- the legacy `mindio_ttp.adaptor` and taskd's elastic callbacks log through MindIO's own logger: the
  `[<tid>][PYH <file>:<line>]` lines of MindIO's stdout format.

Without the variable the worker keeps the adaptor lines every earlier corpus log shows (logger
`tft_adaptor`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import emulated_mindio as ttp

# event -> (file stem, line, text); the text is formatted with the event's fields
Texts = dict[str, tuple[str, int, str]]

_REPAIR = (
    "[repair] rank {rank}, repair type:{repair_type}, src ranks:{src}, dst ranks:{dst}, rank list:{rank_list}, "
    "optim idxs:{optim_idxs}, step:{step}"
)
_ROLLED_BACK = (
    "[rollback] rank {rank} rollback total time consumed:{total:.3f}s, feature rollback:{feature:.3f}s, "
    "gather:{gather:.3f}s, build dataset:{dataset:.3f}s, destroy repair group:{group:.3f}s, "
    "repair log:{log:.3f}s"
)
_LOADED = "rank:{rank} successfully load checkpoint to memory"
_GATHERED = "rank:{rank} successfully gather and rollback at iteration {step}"
_CHECKED = "rank {rank} check uce memory result: {result}"
_CLEANED = "[clean] rank:{rank}, type:retry, cost:{cost:.3f}s, ret:{ret}"
_REPAIRED = "[repair] rank {rank} repair total time consumed:{total:.3f}s"

# MindSpeed-LLM v2.3.0 (1bdd9700), mindspeed_llm/core/high_availability/
LLM_2_3: Texts = {
    "checked": ("tft_stop_clean", 37, _CHECKED),
    "cleaned": ("tft_stop_clean", 58, _CLEANED),
    "repair": ("tft_optimizer_data_repair", 88, _REPAIR),
    "loaded": ("tft_optimizer_data_repair", 385, _LOADED),
    "received": (
        "tft_optimizer_data_repair",
        198,
        "[repair] rank {rank} recv total time consumed:{total:.3f}s, build repair group:{group:.3f}s, "
        "rebuild:{rebuild:.3f}s, recv ckpt:{recv:.3f}s, load ckpt:{load:.3f}s, recv optim:{optim:.3f}s, "
        "recv log args:{log_args:.3f}s.",
    ),
    "repaired": ("tft_optimizer_data_repair", 104, _REPAIRED),
    "gathered": ("tft_rollback", 176, _GATHERED),
    "rolled_back": ("tft_rollback", 52, _ROLLED_BACK),
}

# MindSpeed-LLM v26.0.0 (57c33296): no rebuild, so "rebuild" times the repair group's building
LLM_26: Texts = {
    "checked": ("tft_stop_clean", 38, _CHECKED),
    "cleaned": ("tft_stop_clean", 56, _CLEANED),
    "repair": ("tft_optimizer_data_repair", 67, _REPAIR),
    "loaded": ("tft_optimizer_data_repair", 335, _LOADED),
    "received": (
        "tft_optimizer_data_repair",
        170,
        "[repair] rank {rank} recv total time consumed:{total:.3f}s, rebuild:{group:.3f}s, "
        "recv ckpt:{recv:.3f}s, load ckpt:{load:.3f}s, recv optim:{optim:.3f}s, "
        "recv log args:{log_args:.3f}s.",
    ),
    "repaired": ("tft_optimizer_data_repair", 83, _REPAIRED),
    "gathered": ("tft_rollback", 224, _GATHERED),
    "rolled_back": ("tft_rollback", 56, _ROLLED_BACK),
}

# mind-cluster v7.2rc1 (be58626c) component/taskd/taskd/python/adaptor/elastic_training/; its clean
# callback is the legacy adaptor's
TASKD: Texts = {
    "checked": ("tft_stop_clean", 37, _CHECKED),
    "cleaned": ("tft_stop_clean", 58, _CLEANED),
    "repair": (
        "repair_callback",
        43,
        "repair strategy params: {params}, step: {step}, need_rebuild:{need_rebuild}, "
        "error_ranks: {error_ranks}, repair_info: {repair_info}",
    ),
    "repair_ranks": (
        "repair_callback",
        54,
        "repair rank {rank}, repair type {repair_type},src ranks {src}, dest ranks {dst}, dest ranks "
        "{dst}, rank_list {rank_list} optim idx {optim_idxs}, step {step}",
    ),
    "loaded": ("repair_callback", 250, "rank:{rank} successfully load checkpoint at iteration {step} to memory"),
    "received": ("repair_callback", 164, "repair rank {rank} recv finish"),
    "repaired": ("repair_callback", 68, "repair rank {rank} repair total time consumed: {total:.3f}s"),
    "rollback": ("rollback_callback", 23, "rollback strategy params: {params}, step: {step}"),
    "gathered": ("rollback_callback", 166, _GATHERED),
    "rolled_back": ("rollback_callback", 57, "[rollback] rank {rank} rollback success"),
}

# The corpus' first adaptor, before generations were told apart (logger tft_adaptor)
UNSET: Texts = {
    "checked": ("", 0, _CHECKED),
    "cleaned": ("", 0, _CLEANED),
    "repair": ("", 0, _REPAIR),
    "loaded": ("", 0, _LOADED),
    "repaired": ("", 0, _REPAIRED),
    "gathered": ("", 0, _GATHERED),
    "rolled_back": ("", 0, "[rollback] rank {rank} rollback total time consumed:{total:.3f}s"),
}


@dataclass(frozen=True)
class Generation:
    name: str | None
    texts: Texts
    logger: str  # "mindio" (MindIO's PYH lines), else the Python logger names' package
    rebuilds: bool  # UCE_HIGH_LEVEL: the faulty rank's model and optimizer are destroyed and built anew
    arguments: str | None  # the arguments dump: a file of arguments/, None for none
    dump_title: str = "arguments"  # Megatron-LM's frame; MindSpeed-LLM's own dump has its title
    resets_features: bool = True  # feature_rollback: global memory buffer, stale MoE tracker name, AG list

    def log(self, event: str, **fields) -> None:
        if event not in self.texts:
            return
        stem, line, text = self.texts[event]
        message = text.format(**fields)
        if self.logger == "mindio":
            ttp.py_log("info", f"{stem}.py:{line}", message)
        elif self.name is None:
            logging.getLogger("tft_adaptor").info(message)
        else:
            logging.getLogger(f"{self.logger}.{stem}").info(message)


GENERATIONS = {
    "mindspeed-llm-26": Generation(
        "mindspeed-llm-26",
        LLM_26,
        "mindspeed_llm.core.high_availability",
        rebuilds=False,
        arguments="mindspeed-llm-26.0.0",
        dump_title="MindSpeed-LLM Arguments",
    ),
    "mindspeed-llm-2.3": Generation(
        "mindspeed-llm-2.3",
        LLM_2_3,
        "mindspeed_llm.core.high_availability",
        rebuilds=True,
        arguments="mindspeed-llm-2.3.0",
        dump_title="MindSpeed-LLM Arguments",
    ),
    # not public: texts and behaviour as MindSpeed-LLM moved them in-tree (LLM 5dd34295) and taskd copied them
    "mindio-ttp-legacy": Generation("mindio-ttp-legacy", LLM_2_3, "mindio", rebuilds=True, arguments="megatron-lm-core_v0.12.1"),
    "taskd-elastic": Generation("taskd-elastic", TASKD, "mindio", rebuilds=True, arguments="megatron-lm-core_v0.12.1"),
}


def current() -> Generation:
    """The generation `EMULATED_ADAPTOR_GENERATION` names; unset: the corpus' first adaptor."""
    name = os.environ.get("EMULATED_ADAPTOR_GENERATION")
    if not name:
        return Generation(None, UNSET, "tft_adaptor", rebuilds=False, arguments=None, resets_features=False)
    if name not in GENERATIONS:
        raise ValueError(f"EMULATED_ADAPTOR_GENERATION={name!r}: choose from {sorted(GENERATIONS)}")
    return GENERATIONS[name]
