"""The repair's transfers as the job's groups would take them, and each rank's log of them.

While the repair functions run, ``torch.distributed``'s point-to-point calls are recorded (peer,
shape, dtype), so that the sender's and the receiver's logs can be matched pair by pair afterwards:
a send its receiver never takes (a send loop without the pair dedupe) is named as such, beside the
timeout it causes; a group the adaptor builds in its repair waits the replay's timeout. On the
emulated backend every tensor lives on the CPU, so the group kinds are checked here as HCCL and
gloo would: device tensors travel on the device (HCCL) repair group, never on the gloo one. A
collective on a repair group fails at once: MindIO repairs pair by pair, and the group's other
ranks never join it.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Transfer:
    kind: str  # "send" | "recv"
    peer: int  # the other rank, global
    shape: tuple[int, ...]
    dtype: str


class TransferLog:
    def __init__(
        self,
        device_group: object,
        gloo_group: object,
        is_device_memory: Callable[[torch.Tensor], bool],
        *,
        check_kinds: bool,
        timeout: datetime.timedelta,
    ) -> None:
        self.device_group, self.gloo_group, self.timeout = device_group, gloo_group, timeout
        self._is_device_memory, self._check_kinds = is_device_memory, check_kinds
        self.transfers: list[Transfer] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        saved = {name: getattr(dist, name) for name in (*_POINT_TO_POINT, *_COLLECTIVES, "new_group")}
        dist.new_group = self._timed_group(saved["new_group"])
        for name in _POINT_TO_POINT:
            setattr(dist, name, self._point_to_point(name, saved[name]))
        for name in _COLLECTIVES:
            setattr(dist, name, self._collective(name, saved[name]))
        try:
            yield
        finally:
            for name, function in saved.items():
                setattr(dist, name, function)

    def _timed_group(self, original: Callable) -> Callable:
        """A group the adaptor builds in its repair waits the replay's --timeout, not the default group's."""

        def timed(*args: object, **kwargs: object) -> object:
            kwargs.setdefault("timeout", self.timeout)
            return original(*args, **kwargs)

        return timed

    def _point_to_point(self, name: str, original: Callable) -> Callable:
        def recorded(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
            peer = kwargs.get("dst" if "send" in name else "src", args[0] if args else None)
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            self._check_group(tensor, group)
            if isinstance(peer, int):
                kind = "send" if "send" in name else "recv"
                self.transfers.append(Transfer(kind, peer, tuple(tensor.shape), str(tensor.dtype)))
            return original(tensor, *args, **kwargs)

        return recorded

    def _collective(self, name: str, original: Callable) -> Callable:
        def refused(*args: object, **kwargs: object) -> object:
            group = kwargs.get("group")
            if group is not None and group in (self.device_group, self.gloo_group):
                raise RuntimeError(
                    f"{name} on the repair group: MindIO repairs pair by pair, and the group's other "
                    "ranks never join a collective (send and receive point to point)"
                )
            return original(*args, **kwargs)

        return refused

    def _check_group(self, tensor: torch.Tensor, group: object) -> None:
        if self._check_kinds and group is self.gloo_group and self._is_device_memory(tensor):
            raise RuntimeError(
                "a device tensor sent on the gloo repair group: gloo carries host tensors only; "
                "device tensors go on the HCCL one (get_repair_group())"
            )


def unmatched(rank_logs: dict[int, list[Transfer]]) -> list[str]:
    """Each pair whose sends and receives differ in number, order or shape, in words."""
    problems = []
    pairs = {(rank, item.peer) if item.kind == "send" else (item.peer, rank) for rank, log in rank_logs.items() for item in log}
    for source, destination in sorted(pairs):
        sent = [
            (item.shape, item.dtype) for item in rank_logs.get(source, []) if item.kind == "send" and item.peer == destination
        ]
        taken = [
            (item.shape, item.dtype) for item in rank_logs.get(destination, []) if item.kind == "recv" and item.peer == source
        ]
        if sent == taken:
            continue
        if not sent or not taken:
            problems.append(
                f"rank {source} sends {len(sent)} tensor(s) to rank {destination}, which receives "
                f"{len(taken)}: a {'receive' if taken else 'send'} without its "
                f"{'send' if taken else 'receive'}"
            )
        elif len(sent) != len(taken):
            problems.append(
                f"rank {source} sends {len(sent)} tensor(s) to rank {destination}, which receives "
                f"{len(taken)}: one transfer per (source, destination) pair on both sides "
                "(dict.fromkeys(zip(src_ranks, dest_ranks)))"
            )
        else:
            problems.append(f"rank {source} sends rank {destination} tensors of other shapes or dtypes than it receives")
    return problems
