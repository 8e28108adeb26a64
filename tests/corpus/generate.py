"""Regenerate the corpus logs under tests/corpus/logs/ by running real multi-rank torchrun jobs.

Usage, from the repository root::

    .venv/bin/python tests/corpus/generate.py                 # every run (about 25 minutes on 2 cores)
    .venv/bin/python tests/corpus/generate.py mtp-loss-tracker lossbook
    .venv/bin/python tests/corpus/generate.py --twin NAME...   # an untraced run's twin, with its traceback, in /tmp

Each run is a torchrun job on gloo/CPU (4 to 8 ranks) of `worker.py` with one case of `cases.py`,
under the emulated torch_npu and MindIO of samples/workers/ (the unsafe-data rules are the replay's,
unsafe_doctor/npu/backend.py). The log is torchrun's combined stdout
and stderr as it arrived, in one of three launcher styles: `plain` (as samples/make_logs.py runs:
the last rank's iteration lines, the `[rankN]: ` traceback), `tee` (`--tee 3` with
`TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'`: every line of every rank prefixed) and
`tee-default` (`--tee 3`: torchrun's own `[default<local rank>]:` prefix). The `untraced-*` runs
also set the MindIO release, the adaptor generation and the arguments dump (README.md).

megatron-core 0.7.0 and 0.12.1 runs need those releases in pip targets, put first on PYTHONPATH
(megatron-core has no compiled parts; 0.7.0 imports pkg_resources)::

    .venv/bin/pip install --no-deps --target /tmp/corpus-mc07 megatron-core==0.7.0 'setuptools<81'
    .venv/bin/pip install --no-deps --target /tmp/corpus-mc012 megatron-core==0.12.1

The `release-*` runs import megatron-core 0.17.0 to 0.19.2 from tests/fixtures/rules/release.py's
folder of unpacked releases (fetched there when missing; README.md, "megatron-core 0.17 to 0.19").

Paths of this checkout and of the environment are rewritten to a cluster's (site-packages under
/usr/local/lib/python3.11, the job's code under /home/user/job, frameworks and stand-ins under
/home/user), so the logs read the same wherever the checkout is and never name it; the labels pass
`--source-root` to the folders here. Nothing else is edited.
Timestamps, PIDs and thread ids change on every run; the labels in labels.yaml do not.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "samples"))

sys.path.insert(0, str(REPO / "tests" / "fixtures" / "rules"))

from make_logs import CLUSTER_BIN, CLUSTER_SITE_PACKAGES, JOB, cluster_paths  # noqa: E402
from release import RELEASES, release_root  # noqa: E402

LOGS = HERE / "logs"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
MEGATRON_TARGETS = {"0.7.0": Path("/tmp/corpus-mc07"), "0.12.1": Path("/tmp/corpus-mc012")}
# the releases after the environment's 0.16.1, unpacked where tests/knowledge/test_rules_releases.py finds them
# (tests/fixtures/rules/release.py); they run on this Python with python_312_standins (cases.py)
NEWER_RELEASES = ("0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0", "0.19.2")
CLUSTER_HOME = "/home/user"
MAX_BYTES = 250_000
TIMEOUT = 300
UNSAFE = "RuntimeError: There is unsafe data in the input tensor."
UNTRACED = ("catch OTHER exception", "ex instance:There is unsafe data in the input tensor.", "receive exit message")
CAUGHT_OUT_OF_MEMORY = ("catch OTHER exception", "ex instance:NPU out of memory", "receive exit message")


@dataclass(frozen=True)
class Run:
    case: str  # a key of cases.CASES
    fault: str  # SAMPLE_FAULT: <iteration>:<rank>,<rank>:<uce|hbm>:<point>
    ranks: int = 4
    style: str = "plain"  # plain | tee | tee-default
    megatron: str | None = None  # a release of MEGATRON_TARGETS, else the environment's 0.16.1
    framework: str | None = None  # a folder of frameworks/ put on PYTHONPATH
    expect: tuple[str, ...] = (UNSAFE,)  # what the output must contain
    mindio: str | None = None  # EMULATED_MINDIO_RELEASE: first-public | v7.3 | v26 (unset: the samples' MindIO)
    generation: str | None = None  # EMULATED_ADAPTOR_GENERATION (generations.py); it brings the arguments dump
    arguments_dump: bool = True  # rank 0 prints the generation's arguments dump


RUNS: dict[str, Run] = {
    # megatron-core 0.16.1
    "megatron-mtp-loss-tracker": Run("mtp-loss-tracker", "121:1:uce:forward", style="tee"),
    "megatron-global-memory-buffer": Run("global-memory-buffer", "121:3:hbm:forward"),
    "megatron-rotary-emb-cache": Run("rotary-emb-cache", "121:2:uce:forward", ranks=6, style="tee-default"),
    "megatron-rotary-inv-freq": Run("rotary-inv-freq", "121:0:uce:forward", style="tee"),
    "megatron-router-expert-bias": Run("router-expert-bias", "121:1,3:uce:forward"),
    "megatron-router-local-tokens": Run("router-local-tokens", "121:5:uce:forward", ranks=8, style="tee"),
    "megatron-optimizer-scale-one": Run("optimizer-scale-one", "121:2:hbm:forward"),
    "megatron-optimizer-found-inf": Run("optimizer-found-inf", "121:1:uce:forward", style="tee"),
    "megatron-grad-scaler": Run("grad-scaler", "121:3:uce:forward", style="tee-default"),
    # megatron-core 0.7.0 and 0.12.1
    "megatron-0.7-aux-losses-tracker": Run("legacy-moe-tracker", "121:3:uce:forward", megatron="0.7.0"),
    "megatron-0.12-layer-wise-tracker": Run("legacy-moe-tracker", "121:1:uce:forward", style="tee", megatron="0.12.1"),
    "megatron-0.12-causal-mask": Run("legacy-causal-mask", "121:2:hbm:forward", megatron="0.12.1"),
    # hand-written tracebacks of tests/fixtures/rules/, replayed by the rank they name
    "replay-megatron-main-moe-metrics": Run("replay-moe-metrics-tracker", "121:5:uce:forward", ranks=8, style="tee"),
    "replay-mindspeed-ag-shared-experts": Run("replay-ag-shared-experts-inputs", "121:2:uce:forward"),
    "replay-mindspeed-ag-shared-experts-moe-common": Run(
        "replay-ag-shared-experts-moe-common", "121:6:hbm:forward", ranks=8, style="tee-default"
    ),
    "replay-mindspeed-llm-kvallgather": Run("replay-kvallgather", "121:1:uce:forward", style="tee"),
    "replay-mindspeed-swap-prefetch": Run("replay-swap-prefetch", "121:0:uce:forward"),
    "replay-megatron-0.19-global-aux-loss": Run("replay-global-aux-loss", "121:2:uce:forward", style="tee"),
    "replay-megatron-0.19-qb-beta-accum": Run("replay-qb-beta-accum", "121:1:uce:forward"),
    "replay-megatron-0.19-qb-beta": Run("replay-qb-beta", "121:1:hbm:forward", style="tee"),
    "replay-megatron-0.19-dsa-indexer-loss": Run("replay-dsa-indexer-loss", "121:0:uce:forward"),
    "replay-megatron-0.19-yarn-cos-cached": Run("replay-yarn-cos-cached", "121:6:uce:forward", ranks=8, style="tee-default"),
    "replay-mindspeed-swap-attention-prefetch": Run("replay-swap-attention-prefetch", "121:0:uce:forward", style="tee"),
    "replay-megatron-0.19-fsdp-global-memory-buffer": Run("replay-fsdp-global-memory-buffer", "121:3:uce:forward"),
    "replay-megatron-0.19-activation-offload": Run("replay-activation-offload", "121:0:hbm:forward", style="tee"),
    "replay-megatron-0.19-paged-stash": Run("replay-paged-stash", "121:1:uce:forward"),
    "replay-megatron-0.19-dsa-tilelang-scratch": Run("replay-dsa-tilelang-scratch", "121:2:uce:forward", style="tee"),
    "replay-mindspeed-llm-dsa-indexer-loss": Run("replay-llm-dsa-indexer-loss", "121:3:uce:forward"),
    "replay-mindspeed-llm-hunyuan-rotary": Run("replay-hunyuan-rotary", "121:1:hbm:forward", style="tee"),
    "replay-mindspeed-llm-mtp-loss-tracker": Run("replay-llm-mtp-loss-tracker", "121:2:uce:forward"),
    "replay-mindspeed-llm-fsdp2-rotary": Run("replay-fsdp2-rotary", "121:0:hbm:forward", style="tee"),
    "replay-mindspeed-nanopipe-weight-grad-store": Run("replay-nanopipe-weight-grad-store", "121:1:uce:forward"),
    "replay-mindspeed-fb-overlap-weight-grad-store": Run("replay-fb-overlap-weight-grad-store", "121:2:hbm:forward", style="tee"),
    "replay-mindspeed-fp8-weight-reuse": Run("replay-fp8-weight-reuse", "121:3:uce:forward"),
    "replay-mindspeed-fp8-delayed-scaling": Run("replay-fp8-delayed-scaling", "121:2:hbm:forward", style="tee"),
    "replay-megatron-0.19-logits-saver": Run("replay-logits-saver", "121:0:uce:forward"),
    "replay-mindspeed-swap-layer-input": Run("replay-swap-layer-input", "121:2:hbm:forward", style="tee"),
    # stand-ins at MindSpeed's / MindSpeed-LLM's import paths
    "standin-mindspeed-async-all2all": Run("standin-async-all2all", "121:1:uce:mid-forward", style="tee"),
    "standin-mindspeed-moe-overlap-saved": Run("standin-moe-overlap-saved", "121:3:uce:mid-forward"),
    "standin-mindspeed-flash-attention-mask": Run("standin-flash-attention-mask", "121:2:uce:forward", ranks=6),
    "standin-mindspeed-adaptive-cp-masks": Run("standin-adaptive-cp-masks", "121:1:hbm:forward", style="tee-default"),
    "standin-mindspeed-cp-actual-seq-len": Run("standin-cp-actual-seq-len", "121:0:uce:forward", style="tee"),
    "standin-mindspeed-llm-mtp-position-ids": Run("standin-mtp-position-ids", "121:3:uce:forward"),
    "standin-mindspeed-llm-log-args": Run(
        "standin-log-args",
        "121:3:uce:after-optimizer",
        expect=("An error occurred: There is unsafe data in the input tensor.", "rollback failed, ret: 1"),
    ),
    "standin-mindspeed-ampipe-slices": Run("standin-ampipe-slices", "121:2:uce:forward"),
    "standin-mindspeed-alibi": Run("standin-alibi", "121:3:hbm:forward"),
    "standin-mindspeed-qad-teacher": Run("standin-qad-teacher", "121:0:uce:forward", style="tee"),
    "standin-mindspeed-llm-fsdp2-attn-mask": Run("standin-fsdp2-attn-mask", "121:2:uce:forward", style="tee-default"),
    "standin-modellink-mask-cache": Run("standin-modellink-mask-cache", "121:1:uce:forward"),
    "standin-mindspeed-balanced-moe-hot-experts": Run("standin-balanced-moe-hot-experts", "121:3:uce:forward", style="tee"),
    # user frameworks
    "user-lossbook-meters": Run("lossbook", "123:1:uce:forward", framework="lossbook"),
    "user-packer-buffer": Run("packer", "121:2:hbm:forward", style="tee", framework="packer"),
    "user-maskcache-lru-mask": Run("maskcache", "121:1:uce:forward", ranks=8, style="tee", framework="maskcache"),
    "user-tokencount-counter": Run("tokencount", "121:3:hbm:forward", ranks=6, style="tee-default", framework="tokencount"),
    "user-emashadow-weights": Run("emashadow", "121:3:uce:forward", framework="emashadow"),
    "user-warmupstep-counter": Run("warmupstep", "121:1:uce:forward", style="tee-default", framework="warmupstep"),
    "user-amaxscale-running-max": Run("amaxscale", "121:0:hbm:forward", style="tee", framework="amaxscale"),
    "user-postable-table": Run("postable", "121:2:uce:forward", framework="postable"),
    "user-runstats-binary-op": Run("runstats-binary-op", "121:1:uce:forward", framework="runstats"),
    "user-runstats-call": Run("runstats-call", "121:2:hbm:forward", style="tee", framework="runstats"),
    "user-runstats-subscript": Run("runstats-subscript", "121:3:uce:forward", style="tee-default", framework="runstats"),
    "user-runstats-lambda": Run("runstats-lambda", "121:0:uce:forward", framework="runstats"),
    "user-runstats-dictcomp": Run("runstats-dictcomp", "121:1:hbm:forward", style="tee", framework="runstats"),
    "user-warmupstep-counter-8ranks": Run("warmupstep", "124:6:uce:forward", ranks=8, style="tee", framework="warmupstep"),
    # MindIO v7.3+ (no traceback) and its first public release, each adaptor generation, with the
    # arguments dump of the generation's release
    **{
        f"untraced-{run.mindio}-{run.generation}-{name}": run
        for name, run in (
            (
                "mtp-loss-tracker",
                Run(
                    "mtp-loss-tracker",
                    "121:1:uce:forward",
                    style="tee",
                    megatron="0.12.1",
                    mindio="v26",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "layer-wise-tracker",
                Run(
                    "legacy-moe-tracker",
                    "121:2:uce:forward",
                    megatron="0.12.1",
                    mindio="v7.3",
                    generation="mindspeed-llm-2.3",
                    expect=UNTRACED,
                ),
            ),
            (
                "router-expert-bias",
                Run("router-expert-bias", "121:1,3:uce:forward", mindio="v26", generation="mindspeed-llm-26", expect=UNTRACED),
            ),
            (
                "router-local-tokens",
                Run(
                    "router-local-tokens",
                    "121:5:uce:forward",
                    ranks=8,
                    style="tee",
                    mindio="v7.3",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "optimizer-scale-one",
                Run(
                    "optimizer-scale-one",
                    "121:2:hbm:forward",
                    style="tee-default",
                    mindio="v7.3",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "grad-scaler",
                Run("grad-scaler", "121:3:uce:forward", mindio="v26", generation="mindspeed-llm-26", expect=UNTRACED),
            ),
            (
                "optimizer-found-inf",
                Run(
                    "optimizer-found-inf",
                    "121:0:uce:forward",
                    style="tee",
                    mindio="v26",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "flash-attention-mask",
                Run(
                    "standin-flash-attention-mask",
                    "121:2:uce:forward",
                    ranks=6,
                    mindio="v26",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "layer-wise-tracker",
                Run(
                    "legacy-moe-tracker",
                    "121:1:hbm:forward",
                    style="tee",
                    megatron="0.12.1",
                    mindio="v26",
                    generation="mindio-ttp-legacy",
                    expect=UNTRACED,
                ),
            ),
            (
                "mtp-loss-tracker",
                Run(
                    "mtp-loss-tracker",
                    "121:3:uce:forward",
                    megatron="0.12.1",
                    mindio="v7.3",
                    generation="taskd-elastic",
                    expect=UNTRACED,
                ),
            ),
            (
                "lossbook-meters",
                Run(
                    "lossbook",
                    "123:1:uce:forward",
                    framework="lossbook",
                    mindio="v26",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "packer-buffer",
                Run(
                    "packer",
                    "121:2:hbm:forward",
                    style="tee-default",
                    framework="packer",
                    mindio="v7.3",
                    generation="taskd-elastic",
                    expect=UNTRACED,
                ),
            ),
            (
                "mtp-loss-tracker",
                Run(
                    "mtp-loss-tracker",
                    "121:2:uce:forward",
                    megatron="0.12.1",
                    mindio="first-public",
                    generation="mindspeed-llm-2.3",
                    expect=(UNSAFE, "catch other exception"),
                ),
            ),
        )
    },
    # the measure of the suspects: MindSpeed-LLM 26 buffers, user code under every generation,
    # an aux-loss coefficient that records nothing, and a caught error that is not unsafe data
    **{
        f"untraced-{run.mindio}-{run.generation}-{name}": run
        for name, run in (
            (
                "rotary-inv-freq",
                Run("rotary-inv-freq", "121:1:uce:forward", mindio="v26", generation="mindspeed-llm-26", expect=UNTRACED),
            ),
            (
                "rotary-inv-freq",
                Run(
                    "rotary-inv-freq",
                    "121:3:hbm:forward",
                    ranks=6,
                    style="tee-default",
                    mindio="v7.3",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "rotary-emb-cache",
                Run(
                    "rotary-emb-cache",
                    "121:2:uce:forward",
                    style="tee-default",
                    mindio="v26",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "router-expert-bias",
                Run(
                    "router-expert-bias",
                    "121:2:hbm:forward",
                    style="tee",
                    mindio="v7.3",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "router-local-tokens",
                Run("router-local-tokens", "121:0:uce:forward", mindio="v26", generation="mindspeed-llm-26", expect=UNTRACED),
            ),
            (
                "router-expert-bias-aux-coeff",
                Run(
                    "router-expert-bias-aux-coeff",
                    "121:3:uce:forward",
                    style="tee",
                    mindio="v26",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "maskcache-lru-mask",
                Run(
                    "maskcache",
                    "121:1:uce:forward",
                    style="tee",
                    framework="maskcache",
                    mindio="v26",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "tokencount-counter",
                Run(
                    "tokencount",
                    "121:3:hbm:forward",
                    ranks=6,
                    framework="tokencount",
                    mindio="v7.3",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "emashadow-weights",
                Run(
                    "emashadow",
                    "121:3:uce:forward",
                    style="tee-default",
                    framework="emashadow",
                    mindio="v26",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "warmupstep-counter",
                Run(
                    "warmupstep",
                    "121:1:uce:forward",
                    framework="warmupstep",
                    mindio="v7.3",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "amaxscale-running-max",
                Run(
                    "amaxscale",
                    "121:0:hbm:forward",
                    style="tee",
                    framework="amaxscale",
                    mindio="v26",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "packer-buffer",
                Run(
                    "packer",
                    "121:1:uce:forward",
                    style="tee",
                    framework="packer",
                    mindio="v26",
                    generation="mindspeed-llm-2.3",
                    expect=UNTRACED,
                ),
            ),
            (
                "packer-buffer",
                Run(
                    "packer",
                    "121:0:hbm:forward",
                    framework="packer",
                    mindio="v7.3",
                    generation="mindio-ttp-legacy",
                    expect=UNTRACED,
                ),
            ),
            (
                "mtp-loss-tracker",
                Run(
                    "mtp-loss-tracker",
                    "121:2:uce:forward",
                    style="tee-default",
                    megatron="0.12.1",
                    mindio="v7.3",
                    generation="mindio-ttp-legacy",
                    expect=UNTRACED,
                ),
            ),
            (
                "layer-wise-tracker",
                Run(
                    "legacy-moe-tracker",
                    "121:1:hbm:forward",
                    style="tee",
                    megatron="0.12.1",
                    mindio="v26",
                    generation="taskd-elastic",
                    expect=UNTRACED,
                ),
            ),
            (
                "causal-mask",
                Run(
                    "legacy-causal-mask",
                    "121:3:uce:forward",
                    megatron="0.12.1",
                    mindio="v7.3",
                    generation="mindspeed-llm-2.3",
                    expect=UNTRACED,
                ),
            ),
            (
                "flash-attention-mask",
                Run(
                    "standin-flash-attention-mask",
                    "121:4:uce:forward",
                    ranks=6,
                    style="tee",
                    mindio="v26",
                    generation="mindspeed-llm-2.3",
                    expect=UNTRACED,
                ),
            ),
            (
                "maskcache-flash-attn",
                Run(
                    "maskcache-flash-attn",
                    "121:2:hbm:forward",
                    framework="maskcache",
                    mindio="v7.3",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "tokencount-flash-attn",
                Run(
                    "tokencount-flash-attn",
                    "121:0:uce:forward",
                    style="tee",
                    framework="tokencount",
                    mindio="v26",
                    generation="mindspeed-llm-26",
                    expect=UNTRACED,
                ),
            ),
            (
                "packer-flash-attn",
                Run(
                    "packer-flash-attn",
                    "121:3:uce:forward",
                    style="tee-default",
                    framework="packer",
                    mindio="v26",
                    generation="mindspeed-llm-2.3",
                    expect=UNTRACED,
                ),
            ),
            (
                "out-of-memory",
                Run(
                    "out-of-memory", "121:1:uce:forward", mindio="v26", generation="mindspeed-llm-26", expect=CAUGHT_OUT_OF_MEMORY
                ),
            ),
            (
                "out-of-memory",
                Run(
                    "out-of-memory",
                    "121:3:hbm:forward",
                    style="tee-default",
                    mindio="v7.3",
                    generation="taskd-elastic",
                    expect=CAUGHT_OUT_OF_MEMORY,
                ),
            ),
        )
    },
    "untraced-v26-mindspeed-llm-26-mtp-loss-tracker-no-dump": Run(
        "mtp-loss-tracker",
        "121:0:hbm:forward",
        style="tee",
        megatron="0.12.1",
        mindio="v26",
        generation="mindspeed-llm-26",
        arguments_dump=False,
        expect=UNTRACED,
    ),
    # megatron-core 0.17 to 0.19, the real releases: with the traceback (the samples' MindIO),
    # and with MindIO v7.3+'s catch line alone under taskd's adaptor for Megatron-LM jobs (MindSpeed-LLM's
    # runs only on core 0.12.1), which rebuilds the model and optimizer: a module global is the culprit
    **{
        f"release-{run.megatron}-{run.mindio or 'traced'}-{name}": run
        for name, run in (
            ("layer-wise-tracker", Run("legacy-moe-tracker", "121:2:uce:forward", megatron="0.17.0")),
            ("moe-metrics-tracker", Run("moe-metrics-tracker", "121:1,3:uce:forward", style="tee", megatron="0.18.0")),
            ("mtp-metrics-tracker", Run("mtp-metrics-tracker", "121:0:hbm:forward", style="tee-default", megatron="0.19.2")),
            ("seqlen-stats", Run("seqlen-stats", "121:2:uce:forward", megatron="0.18.2")),
            ("seqlen-stats", Run("seqlen-stats", "121:3:hbm:forward", style="tee", megatron="0.19.2")),
            ("seqlen-stats", Run("seqlen-stats-inter-document", "121:0:uce:forward", style="tee-default", megatron="0.19.0")),
            ("router-expert-bias", Run("router-expert-bias", "121:1:uce:forward", style="tee", megatron="0.17.1")),
            ("rotary-emb-cache", Run("rotary-emb-cache", "121:3:uce:forward", megatron="0.19.0")),
            ("optimizer-found-inf", Run("optimizer-found-inf", "121:1:hbm:forward", style="tee-default", megatron="0.18.2")),
            (
                "mtp-metrics-tracker",
                Run(
                    "mtp-metrics-tracker",
                    "121:2:uce:forward",
                    style="tee",
                    megatron="0.19.2",
                    mindio="v26",
                    generation="taskd-elastic",
                    expect=UNTRACED,
                ),
            ),
            (
                "moe-metrics-tracker",
                Run(
                    "moe-metrics-tracker",
                    "121:0:uce:forward",
                    megatron="0.18.2",
                    mindio="v7.3",
                    generation="taskd-elastic",
                    expect=UNTRACED,
                ),
            ),
            (
                "seqlen-stats",
                Run(
                    "seqlen-stats-inter-document",
                    "121:1:hbm:forward",
                    style="tee-default",
                    megatron="0.19.0",
                    mindio="v26",
                    generation="taskd-elastic",
                    expect=UNTRACED,
                ),
            ),
            (
                "layer-wise-tracker",
                Run(
                    "legacy-moe-tracker",
                    "121:3:uce:forward",
                    megatron="0.17.0",
                    mindio="v26",
                    generation="taskd-elastic",
                    expect=UNTRACED,
                ),
            ),
            (
                "mtp-loss-tracker",
                Run(
                    "mtp-loss-tracker",
                    "121:2:uce:forward",
                    style="tee",
                    megatron="0.17.1",
                    mindio="v7.3",
                    generation="taskd-elastic",
                    expect=UNTRACED,
                ),
            ),
            (
                "moe-metrics-tracker",
                Run(
                    "moe-metrics-tracker",
                    "121:1:hbm:forward",
                    megatron="0.19.0",
                    mindio="v7.3",
                    generation="taskd-elastic",
                    expect=UNTRACED,
                ),
            ),
        )
    },
    # negatives
    "negative-out-of-memory": Run("out-of-memory", "121:1:uce:forward", expect=("torch.OutOfMemoryError: NPU out of memory",)),
    "negative-clean-recovery": Run(
        "clean-recovery", "121:2:hbm:forward", style="tee", expect=("start notify all rank normal...", "[after training is done]")
    ),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(run: Run) -> dict[str, str]:
    paths = [str(REPO / "samples" / "workers"), str(HERE / "standins"), str(REPO)]
    if run.framework:
        paths.append(str(HERE / "frameworks" / run.framework))
    if run.megatron in NEWER_RELEASES:
        target = release_root(run.megatron)
        if target is None:
            raise SystemExit(f"megatron-core {run.megatron} cannot be had in {RELEASES}: see this script's docstring")
        paths.insert(0, str(target))
    elif run.megatron:
        target = MEGATRON_TARGETS[run.megatron]
        if not (target / "megatron").is_dir():
            raise SystemExit(f"megatron-core {run.megatron} is not in {target}: see this script's docstring")
        paths.insert(0, str(target))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(paths), SAMPLE_FAULT=run.fault)
    for name in (
        "EMULATED_MINDIO_RELEASE",
        "EMULATED_ADAPTOR_GENERATION",
        "CORPUS_ARGUMENTS_DUMP",
        "CORPUS_RELEASE_STANDINS",
        "CORPUS_MEGATRON_ARGUMENTS",
    ):
        env.pop(name, None)
    if run.megatron in NEWER_RELEASES:
        env["CORPUS_RELEASE_STANDINS"] = "1"
        env["CORPUS_MEGATRON_ARGUMENTS"] = f"megatron-lm-core_v{run.megatron}"  # arguments/from_release.py
    if run.mindio:
        env["EMULATED_MINDIO_RELEASE"] = run.mindio
    if run.generation:
        env["EMULATED_ADAPTOR_GENERATION"] = run.generation
    if not run.arguments_dump:
        env["CORPUS_ARGUMENTS_DUMP"] = "0"
    if run.style == "tee":
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:"
    return env


def launch(run: Run) -> str:
    """Run the job; return torchrun's console output."""
    launcher = ["--nproc-per-node", str(run.ranks), "--master-port", str(free_port())]
    if run.style != "plain":
        launcher += ["--tee", "3"]
    job = subprocess.run(
        [TORCHRUN, *launcher, "tests/corpus/worker.py", "--case", run.case],
        cwd=REPO,
        env=environment(run),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT,
    )
    return job.stdout


FOLDERS = [  # the environment first: it may be a folder of the checkout (.venv)
    (Path(sysconfig.get_paths()["purelib"]), CLUSTER_SITE_PACKAGES),
    (Path(sys.executable).parent, CLUSTER_BIN),
    *((target, CLUSTER_SITE_PACKAGES) for target in MEGATRON_TARGETS.values()),
    *((RELEASES / version, CLUSTER_SITE_PACKAGES) for version in NEWER_RELEASES),
    (HERE / "standins" / "mindspeed_llm", f"{CLUSTER_HOME}/MindSpeed-LLM/mindspeed_llm"),
    (HERE / "standins" / "mindspeed", f"{CLUSTER_HOME}/MindSpeed/mindspeed"),
    (HERE / "frameworks", CLUSTER_HOME),
    (HERE, JOB),
    (REPO / "samples" / "workers", JOB),
    (REPO, JOB),
]


# torch's logging names a module relative to the first sys.path entry holding it: the checkout, when the
# environment is a folder of it (.venv)
SITE_PACKAGES_IN_REPO = os.path.relpath(sysconfig.get_paths()["purelib"], REPO) + "/"


def generate(name: str, run: Run, folder: Path = LOGS) -> None:
    text = cluster_paths(launch(run), FOLDERS)
    if not SITE_PACKAGES_IN_REPO.startswith(".."):
        text = text.replace(SITE_PACKAGES_IN_REPO, "")
    path = folder / f"{name}.log"
    missing = [needle for needle in run.expect if needle not in text]
    if missing:
        kept = Path("/tmp") / f"{name}.log.failed"
        kept.write_text(text)
        raise SystemExit(f"{name}: the run did not produce {missing!r}; its output is in {kept}")
    if len(text.encode()) > MAX_BYTES:
        raise SystemExit(f"{name}: {len(text.encode())} bytes, over the {MAX_BYTES} limit")
    path.write_text(text)
    print(f"wrote {path} ({len(text.encode())} bytes)", flush=True)


def twin(run: Run) -> Run:
    """The same case, fault and generation with the samples' MindIO, which lets the traceback show:
    what checks an untraced log's culprit (README.md, "Untraced logs")."""
    return replace(run, mindio=None, expect=(UNSAFE,))


def main(names: list[str]) -> None:
    twins = names[:1] == ["--twin"]
    names = names[twins:]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        raise SystemExit(f"unknown run(s) {unknown}; choose from {sorted(RUNS)}")
    LOGS.mkdir(exist_ok=True)
    for name in names or RUNS:
        if twins:
            generate(f"{name}.twin", twin(RUNS[name]), Path(tempfile.gettempdir()))
        else:
            generate(name, RUNS[name])


if __name__ == "__main__":
    main(sys.argv[1:])
