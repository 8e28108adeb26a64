"""Sample rollback callback in the in-tree shape of MindSpeed-LLM 2.3 and later.

From MindSpeed-LLM 2.3 the adaptor lives in the framework's own tree, under
``mindspeed_llm/core/high_availability/``: the rollback here, the repair functions in
``tft_optimizer_data_repair.py``. Written for unsafe-doctor's samples and tests in that shape.
"""

from megatron.core import mpu
from megatron.training import get_args


def rollback_callback(step, train_args, ctx):
    args = get_args()
    args.iteration = step
    feature_rollback()


def feature_rollback():
    args = get_args()
    if getattr(args, "num_experts", None):
        mpu._MOE_AUX_LOSSES_LOGGING_TRACKER = {}  # the megatron-core <= 0.7 name
