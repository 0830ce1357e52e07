"""Context parallelism: the ranks of the mesh's cp axis each hold 1/cp of every sequence, the
design of the Llama 3 paper (Dubey et al. 2024, section 3.3.2): all-gather the keys and values,
attend locally. torch's own `context_parallel` (ring attention) has no CPU path; this one runs
the same code on gloo and NCCL.

- Load balance: the sequence is cut into 2·cp chunks and rank i holds chunks i and 2·cp−1−i, so
  under a causal mask every rank has the same attention work (an early chunk attends to few keys,
  its partner to many).
- Per attention layer, K and V are all-gathered over cp (autograd-aware: the backward
  reduce-scatters their gradients) and put in sequence order; each of the rank's query chunks
  attends the keys up to its own end, causally (lower-right aligned). Every rank so keeps the
  whole sequence's K and V for backward: small under grouped-query attention, as the paper notes.
  RoPE and learned positions use global positions.
- The trainer hands each cp rank its chunks of the batch (`shard`): the cp ranks of one
  data-parallel replica read the same rows. Each rank's loss is the mean over its tokens; every
  rank holds as many, so averaging over cp (the gradient reduction's mean) is the mean over the
  whole sequence.
- Model states are sharded over dp_shard × cp (parallel/mesh.py), as torchtitan and Megatron do:
  the cp ranks hold the same parameters, so they are data-parallel ranks for the states.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from trainfit.models.common import WholeSequence

_all_gather_with_grad = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
"""The differentiable all-gather: all_gather_single_autograd in newer torch; torch 2.11 and earlier name it
all_gather_tensor_autograd (the same call, deprecated where the new name exists)."""


class ContextParallel(WholeSequence):
    """This rank's two chunks of every sequence, and attention over all of it (module docstring)."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        self.mesh = cp_mesh
        self.rank = cp_mesh.get_local_rank()
        self.size = cp_mesh.size()
        self._cache: dict[tuple, torch.Tensor] = {}

    def chunks(self) -> tuple[int, int]:
        """The indices of this rank's two chunks among the 2·cp."""
        return self.rank, 2 * self.size - 1 - self.rank

    def shard(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a [B, T] batch: its two chunks, concatenated: [B, T / cp]."""
        pieces = tokens_BT.chunk(2 * self.size, dim=1)
        return torch.cat([pieces[i] for i in self.chunks()], dim=1)

    def rows(self, local_len: int) -> torch.Tensor:
        key = ("rows", local_len)
        if key not in self._cache:  # built once per length, not at every layer
            chunk = local_len // 2
            self._cache[key] = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in self.chunks()]).to(
                self.mesh.device_type)
        return self._cache[key]

    def attention(self, q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                  window_TT: torch.Tensor | None = None, scale: float | None = None, softcap: float = 0.0,
                  window: int = 0, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
        """Each of this rank's two query chunks attends the keys from position 0 to its own chunk's
        end, causally within its chunk (a lower-right-aligned causal mask of [chunk, end]), its dot products
        multiplied by `scale` (None: 1 / sqrt(head_dim)). No sliding
        window: the layout refuses one shorter than the sequence (parallel/resolve.py)."""
        if window_TT is not None or softcap or sinks_H is not None:
            raise ValueError("context parallelism runs neither a sliding window, soft-capped scores nor attention "
                             "sinks; the layout refuses them")
        chunk = q_BHTK.shape[2] // 2
        k_BGSK, v_BGSK = self._gather_in_order(k_BGTK), self._gather_in_order(v_BGTK)
        gqa = q_BHTK.shape[1] != k_BGTK.shape[1]
        out = []
        for part, c in enumerate(self.chunks()):
            end = (c + 1) * chunk
            with self.kernel():
                out.append(F.scaled_dot_product_attention(
                    q_BHTK[:, :, part * chunk:(part + 1) * chunk], k_BGSK[:, :, :end], v_BGSK[:, :, :end],
                    attn_mask=self._mask(chunk, end, q_BHTK.dtype), scale=scale, enable_gqa=gqa))
        return torch.cat(out, dim=2)

    def _mask(self, chunk: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """[chunk, end] additive mask in the queries' dtype: query i (at global position end - chunk
        + i) may attend key j when j <= end - chunk + i (0 there, -inf elsewhere). Built once per
        shape and dtype and shared by every layer: SDPA converts a boolean mask to this form at each
        call, and each layer's attention would save its own copy for backward. (torch's CausalBias
        would let CUDA's flash kernels skip the mask, but as a tensor subclass it cannot be created
        under the memory instruments' dispatch modes.)"""
        key = ("mask", chunk, end, dtype)
        if key not in self._cache:
            rows = torch.arange(chunk)[:, None] + (end - chunk)
            hidden = torch.arange(end)[None, :] > rows
            mask = torch.zeros(chunk, end, dtype=dtype).masked_fill_(hidden, float("-inf"))
            self._cache[key] = mask.to(self.mesh.device_type)
        return self._cache[key]

    def _gather_in_order(self, x_BGTK: torch.Tensor) -> torch.Tensor:
        """Every rank's tokens of x, in sequence order: [B, G, 2·cp·chunk, K]. The functional
        all-gather concatenates along dim 0 in rank order (rank r: chunks r and 2·cp−1−r), so the
        sequence goes first and the chunks are put back in order (a copy, the one attention keeps)."""
        x_TBGK = x_BGTK.permute(2, 0, 1, 3).contiguous()
        gathered = _all_gather_with_grad(x_TBGK, 0, self.mesh)
        pieces = gathered.chunk(2 * self.size, dim=0)  # rank r's two chunks are pieces 2r and 2r + 1
        last = 2 * self.size - 1
        ordered = [pieces[2 * c] if c < self.size else pieces[2 * (last - c) + 1] for c in range(2 * self.size)]
        return torch.cat(ordered, dim=0).permute(1, 2, 0, 3)
