"""What one replay runs, as plain data: `verify` makes it, every rank reads it (as JSON under torchrun).

No torch here, so the plan is made and checked before any rank starts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from unsafe_doctor.log.global_name import GlobalName

if TYPE_CHECKING:
    from unsafe_doctor.knowledge.rules import ParameterRole

ReplayMode = Literal["adaptor", "block"]
MODES: tuple[ReplayMode, ...] = ("adaptor", "block")
RUNS = ("unpatched", "patched")
MAX_RANKS = 16
MAX_TIMEOUT = 86400.0  # a day: more is no timeout, and far more overflows the process groups' timedelta


@dataclass(frozen=True)
class Target:
    """One finding's global, and how its fix is recognised in the adaptor."""

    key: str  # marker key of its fix block
    name: GlobalName[str, str]  # its dotted name is how reports show it
    scenario: int
    rule: str | None
    switches: tuple[str, ...] = ()  # framework arguments the fix's guards read: switched on in the replay
    probe: str | None = None  # the rule's probe, by name (replay/probes.py); None: the generic probe
    releases: str | None = None  # the framework releases the rule holds for (a specifier, ">=0.8,<0.13"); None: any
    as_main: bool = False  # the global is the entry script's: the job holds it in __main__, not under its module's name
    suspect: int | None = None  # the suspect number a person chose it as (verify --suspect); None: the log names the global

    def names(self, name: str) -> bool:
        """`name` (what the sentinel or a dying step calls a global) is this target's global: its dotted name,
        or, where the target has no owner (a suspect's rule names no class), a class of its module
        holding an attribute of its name, as `TopKRouter.expert_bias` is."""
        module, owner = self.name.module, self.name.owner
        if name == self.name.dotted:
            return True
        held_by, _, variable = name.removeprefix(f"{module}.").rpartition(".")
        return owner is None and name.startswith(f"{module}.") and held_by.isidentifier() and variable == self.name.variable


@dataclass(frozen=True)
class Block:
    """A marked fix block as written in the adaptor."""

    key: str
    role: str  # rollback | send | recv | other
    function: str
    path: str
    line: int
    code: str
    parameters: tuple[str, ...]
    own_group: str | None


@dataclass(frozen=True)
class AdaptorCode:
    """One adaptor file, as written (patched) and with our blocks taken out (unpatched)."""

    path: str
    module: str  # the name it is imported under (its dotted path under a source root, else its stem)
    unpatched: str
    patched: str
    functions: tuple[str, ...]


@dataclass(frozen=True)
class ReplayPlan:
    targets: tuple[Target, ...]
    blocks: tuple[Block, ...]
    files: tuple[AdaptorCode, ...]
    functions: dict[str, str]  # role -> adaptor function name
    parameters: dict[ParameterRole, tuple[str, ...]]  # role -> what holds it (knowledge.AdaptorProfile.parameters)
    repair_group_imports: tuple[str, ...]  # where the profile's blocks get their repair group from
    mode: ReplayMode
    world_size: int
    faulty: int
    replica: int  # the replica whose state at the fault the faulty rank must get back
    source_roots: tuple[str, ...]
    replicas: tuple[int, ...] = ()  # every rank that sends to the faulty one (MindIO: one per optimizer index)
    standins: tuple[str, ...] = ()  # modules the unpatched adaptor imports: stood in where they do not import here
    group_getters: tuple[str, ...] = ()  # names of the repair-group getters the adaptor generations import
    rebuilds_model: bool = True  # knowledge.AdaptorProfile.rebuilds_model: False leaves the model's buffers unsafe
    ranks_are_lists: bool = True  # knowledge.AdaptorProfile.ranks_are_lists
    group_parameter: str | None = None  # the adaptor functions' parameter that holds the repair group
    probe: str | None = None  # the user's MODULE:FUNCTION that builds and touches the state
    steps: int = 2  # training steps before the fault
    timeout: float = 60.0
    notes: tuple[str, ...] = field(default=())
    as_is: bool = False  # the patched run is the adaptor as it stands, the sentinel's blocks too: does it survive?

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ReplayPlan:
        data = json.loads(text)
        data["targets"] = tuple(
            Target(**{**item, "name": GlobalName(**item["name"]), "switches": tuple(item["switches"])})
            for item in data["targets"]
        )
        data["blocks"] = tuple(Block(**{**item, "parameters": tuple(item["parameters"])}) for item in data["blocks"])
        data["files"] = tuple(AdaptorCode(**{**item, "functions": tuple(item["functions"])}) for item in data["files"])
        data["parameters"] = {role: tuple(names) for role, names in data["parameters"].items()}
        for name in ("source_roots", "repair_group_imports", "notes", "replicas", "standins", "group_getters"):
            data[name] = tuple(data[name])
        return cls(**data)

    def blocks_for(self, role: str) -> tuple[Block, ...]:
        return tuple(block for block in self.blocks if block.role == role)
