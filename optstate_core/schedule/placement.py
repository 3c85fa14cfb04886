"""Where each state lives and in which codec: the policy's answer, FSDP2's block limits, the GPU budget."""
from __future__ import annotations

from typing import List, Optional

import torch

from ..state.codecs import FP32Codec
from ..state.dtensor import is_dtensor, slab_placements
from ..state.master_weights import MASTER_KEY
from ..policy import Policy
from ..state.store import is_scalar_state, keeps_own_shape
from ..step.work import Work


class Placement:
    """Codec and tier per (parameter, state key, step); which parameters stay resident under a budget."""

    def __init__(self, policy: Policy, gpu_budget=None, staging_bytes: int = 256 * 2**20, offload_all: bool = False):
        self.policy = policy
        self.gpu_budget = gpu_budget  # bytes (int), fraction of free GPU memory (float), or None
        self.staging_bytes = staging_bytes
        self.force_tier: Optional[str] = None  # "host" after offload()
        self.offload_all = offload_all  # wrap(offload=True): every state in host memory
        self.resident: Optional[set] = None  # ids of parameters kept on the device under the budget

    def codec_of(self, w: Work, key: str, step: int):
        """The policy's codec, unless the parameter's sharding cannot keep whole blocks per rank."""
        codec = self.policy.codec_for(w.info, key, step)
        if not codec.lossless and is_dtensor(w.key) and slab_placements(w.key, codec.granularity) is None:
            return FP32Codec()
        return codec

    def tier_of(self, w: Work, key: str, step: int) -> str:
        """Where a state lives between steps: the policy's answer, then offload and the GPU budget."""
        if self.force_tier is not None:
            return self.force_tier
        tier = self.policy.tier_for(w.info, key, step)
        if self.offload_all:
            return "host"
        if tier == "device" and self.resident is not None and id(w.key) not in self.resident:
            return "host"
        return tier

    def budget_bytes(self, device: torch.device) -> Optional[int]:
        """The budget in bytes (a fraction is resolved against free GPU memory once)."""
        if self.gpu_budget is None:
            return None
        if isinstance(self.gpu_budget, float):
            if device.type != "cuda":
                raise ValueError(f"gpu_budget={self.gpu_budget!r} is a fraction of free GPU memory, but the "
                                 f"parameters are on {device}; give a byte count instead")
            free = torch.cuda.mem_get_info(device)[0]
            self.gpu_budget = int(free * self.gpu_budget)
        return self.gpu_budget

    def staging_size(self, device: torch.device) -> int:
        """Bytes of the device staging ring that offloaded state streams through."""
        budget = self.budget_bytes(device)
        return self.staging_bytes if budget is None else max(4096, min(self.staging_bytes, budget // 2))

    def assign_residency(self, works: List[Work], step: int) -> None:
        """Under a GPU budget: keep state resident beside the staging ring, spread evenly over the
        parameters in index order (:func:`spread_residency`); the rest streams from host memory
        every step."""
        if self.gpu_budget is None:
            self.resident = None
            return
        if not works:  # a step with no gradients (all released in backward): the assignment stands
            return
        device = works[0].param.device
        room = self.budget_bytes(device) - self.staging_size(device)
        needs = []
        for w in works:
            keys = [k for k, v in w.state.items() if not is_scalar_state(v) and not keeps_own_shape(v, w.key)
                    and k != MASTER_KEY] or ["exp_avg", "exp_avg_sq"]
            need = 0
            for key in keys:
                codec = self.codec_of(w, key, step)
                need += codec.nbytes(w.rows, w.cols, w.param.dtype if not codec.lossless else torch.float32)
            master = self.policy.master_codec(w.info)  # the master-weight correction follows its parameter
            if master is not None:
                need += master.nbytes(w.rows, w.cols, torch.float32)
            needs.append(need)
        keep = spread_residency(needs, room)
        self.resident = {id(w.key) for w, stays in zip(works, keep) if stays}


def spread_residency(needs: List[int], room: int) -> List[bool]:
    """Which of these state sizes (parameters in index order) stay resident in ``room`` bytes:
    the resident share spread evenly along the order (a parameter stays when the share it has
    accrued covers half of it), then the room left filled in order. Spread, the streamed state is
    spread over backward too: its copies overlap all of backward's compute instead of queueing at
    one end of it while the other end moves nothing (the benchmarks journal's section 29 compared it with
    the first parameters kept while they fit: 0.91x against 0.87x of resident at 32 GB)."""
    total = sum(needs)
    if total <= room:
        return [True] * len(needs)
    keep = [False] * len(needs)
    share, credit = max(room, 0) / total, 0.0
    for i, need in enumerate(needs):
        credit += need * share
        if need <= room and credit >= need / 2:
            keep[i] = True
            credit -= need
            room -= need
    for i, need in enumerate(needs):  # what rounding left over
        if not keep[i] and need <= room:
            keep[i] = True
            room -= need
    return keep
