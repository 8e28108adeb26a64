"""What kind of global a fix template is chosen for: its annotation and every value it is given
agree, or it is a value of a kind the source does not show."""

from __future__ import annotations

import textwrap

import pytest

from unsafe_doctor.knowledge.classify import global_kind
from unsafe_doctor.knowledge.subject import Subject
from unsafe_doctor.log.global_name import GlobalName
from unsafe_doctor.source.workspace import Workspace

CASES = {
    "annotated tensor or None": ("import torch\n_EMA: torch.Tensor | None = None\n", "tensor"),
    "Optional[Tensor]": ("from typing import Optional\nfrom torch import Tensor\n_EMA: Optional[Tensor] = None\n", "tensor"),
    "a string annotation": ('_EMA: "torch.Tensor" = None\n', "tensor"),
    "a dict annotation": ("import torch\n_EMA: dict[str, torch.Tensor] = {}\n", "dict"),
    "a List annotation": ("from typing import List\n_EMA: List = []\n", "list"),
    "a factory at module level": ("import torch\n_EMA = torch.zeros(4)\n", "tensor"),
    "None, then a factory in a function that declares it global": (
        "import torch\n_EMA = None\n\n\ndef init(device):\n    global _EMA\n    _EMA = torch.ones((), device=device)\n",
        "tensor",
    ),
    "a factory in a function that does not declare it global": (
        "import torch\n_EMA = None\n\n\ndef init(device):\n    _EMA = torch.ones((), device=device)\n    return _EMA\n",
        "value",
    ),
    "an annotation and a helper's value": ("import torch\n_EMA: torch.Tensor = make()\n", "tensor"),
    "a helper's value alone": ("_EMA = make()\n", "value"),
    "a dict, then a tensor": ("import torch\n_EMA = {}\n\n\ndef init():\n    global _EMA\n    _EMA = torch.zeros(4)\n", "value"),
    "an annotation a template does not use": ("_EMA: int = 0\n", "value"),
    "a union of two kinds": ("import torch\n_EMA: torch.Tensor | dict = None\n", "value"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_kind_comes_from_the_annotation_and_the_values(case, tmp_path):
    text, kind = CASES[case]
    (tmp_path / "state.py").write_text(textwrap.dedent(text))
    subject = Subject.of_global(GlobalName("state", None, "_EMA"), str(tmp_path / "state.py"), 1)
    assert global_kind(subject, Workspace([tmp_path])) == kind
