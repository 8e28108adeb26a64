"""Stand-in for the corpus at MindSpeed's import path (not MindSpeed's code): the distillation teacher."""

import torch

_teacher_manager = None


class TeacherModelManager:
    def __init__(self, hidden_size, device):
        self.teacher_model = torch.nn.Linear(hidden_size, hidden_size, device=device)
        self.teacher_model.requires_grad_(False)


def get_teacher_manager(hidden):
    """The frozen teacher, loaded once beside the student."""
    global _teacher_manager
    if _teacher_manager is None:
        _teacher_manager = TeacherModelManager(hidden.shape[-1], hidden.device)
    return _teacher_manager


def teacher_logits(hidden):
    return get_teacher_manager(hidden).teacher_model(hidden)
