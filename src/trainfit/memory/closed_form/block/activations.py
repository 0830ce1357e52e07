"""What one block keeps from its forward to its backward under each activation-checkpointing policy
(`block_terms`), and what a checkpointed block keeps that an unwrapped one does not (`policy_only_terms`),
so that its recompute's size follows. The pieces: memory/closed_form/block/activation_terms.py (the vocabulary and the
conventions), attention_activations.py, moe_activations.py; the backward's own tensors are
backward_transients.py's, a stage's ends stage_activations.py's. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.config import ModelConfig
from trainfit.memory.closed_form.block.activation_terms import (
    FP32,
    ActDtypes,
    Terms,
    block_shapes,
    ffn_consumers,
    layer_of,
    norm_input_bytes,
    norm_saved,
    post_norms_saved,
    sandwich_post_norms_saved,
    scores_kept,
    swiglu_saved,
    ungated_mlp,
)
from trainfit.memory.closed_form.block.attention_activations import attention_kept, attention_saved
from trainfit.memory.closed_form.block.moe_activations import Routing, balanced_routing, moe_saved
from trainfit.models.block_spec import block_linears
from trainfit.models.checkpoint_policy import kept_linear_shares


def block_terms(m: ModelConfig, d: ActDtypes, policy: str, routing: Routing | None = None, cp: int = 1,
                tp: int = 1) -> Terms:
    """What one block keeps from its forward to its backward, input included (MoE: `routing`, by
    default dropless and balanced; `cp`, `tp`: context- and tensor-parallel degrees)."""
    D, q_dim, kv_dim, H, _ = block_shapes(m)
    c, a = d.compute, d.stream
    if policy == "full":
        return Terms(seq=a * D)  # the checkpoint keeps the block input only
    if policy in ("selective", "selective-alternate"):
        return _selective_kept(m, d, policy, routing, tp, cp)
    if policy != "none":
        raise ValueError(f"activation checkpointing policy {policy!r}: choose none, selective, "
                         "selective-alternate or full")
    # Block input (for RMSNorm with a 16-bit stream, its fp32 copy replaces it: see norm_saved) and
    # the mid-block residual h, each saved at 4 bytes by the norm that reads it (RMSNorm) or at
    # stream bytes (LayerNorm saves its input as is).
    placement = layer_of(m).norm_placement
    if placement == "post":
        terms = post_norms_saved(m, d) + attention_saved(m, d, cp)
    else:
        residual = 2 * norm_input_bytes(m, d) * D
        terms = Terms(seq=residual) + norm_saved(m, d, 3) + attention_saved(m, d, cp) + \
            norm_saved(m, d, ffn_consumers(m))
        if placement == "sandwich":
            terms += sandwich_post_norms_saved(m, d)
    if ungated_mlp(m):
        return terms + Terms(tp=2 * c * m.ffn_dim)  # fc1 out (GELU input), GELU out (fc2 input)
    if m.num_experts:
        return terms + moe_saved(m, d, routing or balanced_routing(m))
    return terms + Terms(tp=swiglu_saved(c, m.ffn_dim))


@dataclass(frozen=True)
class PolicyOnly:
    """What a checkpointing policy saves that an unwrapped block does not (see policy_only_terms)."""

    released: Terms
    """Consumed by the block's recompute in backward, which frees them from the policy's cache."""
    kept: Terms
    """Alive until the block's backward ends."""
    released_last: Terms = Terms()
    """The part of `released` the recompute's last operator consumes, alive at its end: an MoE
    block's shared experts' w2 output (their sum with the routed output)."""


def regathered_terms(m: ModelConfig, d: ActDtypes) -> Terms:
    """What parallel.sp_recompute_gather changes in an unwrapped block (parallel/tensor_parallel.py's
    _RegatherInBackward): its column groups' consumers no longer save the gathered input (the attention's
    q, k, v; a dense MLP's up and gate projections: each its own cast under autocast, else one shared
    tensor); each group keeps its input's sequence shard instead, in the stream's dtype. An MoE
    feed-forward is replicated on the tp ranks, no column group: it keeps what it saves."""
    D = m.dim
    groups = [3] if m.num_experts else [3, ffn_consumers(m)]
    return Terms(gathered=-sum(norm_saved(m, d, consumers).gathered for consumers in groups),
                 seq=len(groups) * d.stream * D)


def _row_parallel_reductions(m: ModelConfig, d: ActDtypes, tp: int) -> Terms:
    """Tensor parallelism under the selective policies (models/checkpoint_policy.py): the reduced outputs of
    the row-parallel projections (wo; w2 / fc2 unless the feed-forward is an MoE, whole on the tp
    ranks), the reduce-scatter's sequence shard with sequence parallelism, the all-reduce's whole
    tensor without: the residual stream's shape (`seq`)."""
    return _reduction(m, d, tp) + (Terms() if m.num_experts else _reduction(m, d, tp))


def _reduction(m: ModelConfig, d: ActDtypes, tp: int) -> Terms:
    """One row-parallel projection's reduced output (see _row_parallel_reductions)."""
    return Terms(seq=d.compute * m.dim) if tp > 1 else Terms()


def policy_keeps_shared_output(m: ModelConfig, r: Routing, policy: str) -> bool:
    """Whether a checkpointing policy saves the shared experts' w2 output (selective: every matmul's;
    selective-alternate: when w2 is an odd-numbered matmul)."""
    return policy != "none" and _kept_shares(m, policy, r).get("shared_w2", 0.0) == 1.0


def _all_to_all_outputs(m: ModelConfig, d: ActDtypes, r: Routing) -> Terms:
    """Expert parallelism under the selective policies (models/checkpoint_policy.py: they keep all-to-alls): the
    dispatch all-to-all's output (the rows received) and the combine's (the rows returned)."""
    return Terms(gathered=(r.rows + r.returned) * d.compute * m.dim if r.ep > 1 else 0)


def _kept_shares(m: ModelConfig, policy: str, r: Routing | None) -> dict[str, float]:
    """The share of each linear's output a wrapped block keeps (models/checkpoint_policy.py) on a
    rank of `r`'s routing (its experts' parity)."""
    r = r or (balanced_routing(m) if m.num_experts else None)
    return kept_linear_shares(m, policy, r.local_experts(m.num_experts) if r else 0, bool(r and r.capacity))


def _selective_kept(m: ModelConfig, d: ActDtypes, policy: str, routing: Routing | None, tp: int, cp: int = 1
                    ) -> Terms:
    """The selective policies: the block input, and the outputs models/checkpoint_policy.py says they
    keep: of the fused attention (attention_kept), of tp's reductions, of expert parallelism's
    all-to-alls, and of the matmuls it keeps (selective: all; selective-alternate: the odd-numbered
    ones), each linear's at its output's size: a column-parallel output is split over tp, a
    row-parallel one is the partial sum before the reduction (whole). Routed experts keep their
    rows' outputs by the share of the rank's experts that keep them (balanced, of their rows)."""
    D, q_dim, kv_dim, H, _ = block_shapes(m)
    c = d.compute
    keep = _kept_shares(m, policy, routing)
    linears = {linear.name: linear for linear in block_linears(m)}

    def out(name: str) -> int:  # bytes per token of a kept linear's output
        return int(keep[name]) * c * linears[name].out_features

    kept = Terms(seq=d.stream * D, tp=out("wq") + out("wk") + out("wv")) + attention_kept(m, d, cp, policy)
    kept += Terms(gathered=out("wo"))  # under TP: the partial sum before the reduce-scatter
    kept += _row_parallel_reductions(m, d, tp)
    if ungated_mlp(m):
        return kept + Terms(gathered=out("w2"), tp=out("w1"))
    if not m.num_experts:
        return kept + Terms(gathered=out("w2"), tp=out("w1") + out("w3"))
    F, r = m.expert_ffn_dim, routing or balanced_routing(m)
    routed = r.rows * c * (keep["experts_w1"] * F + keep["experts_w3"] * F + keep["experts_w2"] * D)
    kept += Terms(gathered=out("router") + routed)
    kept += _all_to_all_outputs(m, d, r)
    shared = out("shared_w2") + out("shared_w1") + out("shared_w3") if m.num_shared_experts else 0
    return kept + Terms(gathered=shared)


def policy_only_terms(m: ModelConfig, d: ActDtypes, policy: str, tp: int = 1,
                      routing: Routing | None = None, cp: int = 1) -> PolicyOnly:
    """Tensors a checkpointed block keeps that the unwrapped block does not save, so that its
    recompute rebuilds (unwrapped - policy) + released + kept:
    - the block input in a 16-bit stream, for Llama: unwrapped, RMSNorm saves only its fp32 copy;
    - selective: matmul outputs whose consumers keep nothing of them: wo's and w2's (fc2's) feed
      residual adds; Llama's wq and wk outputs feed RoPE, whose outputs are what SDPA saves; an
      MoE router's logits feed a softmax, which saves its output; tp's reduced outputs of wo and
      w2 (fc2) feed residual adds. The recompute consumes all but the last matmul's (w2 / fc2)
      and its reduction, where it stops; an MoE block's it consumes all (it runs to the end).
    - selective-alternate: the same among what it keeps: Llama's wq (not wk), w2 and the
      reductions; GPT-2's reductions; an MoE's router and, when kept, its shared experts' w2.
    - the math attention kernel's kept bmm outputs (attention_kept): the unwrapped block saves
      neither (softmax's output and the output projection's contiguous copy instead); the
      recompute consumes both."""
    D, q_dim, kv_dim, _, _ = block_shapes(m)
    c = d.compute
    block_input = Terms(seq=d.stream * D if norm_input_bytes(m, d) != d.stream else 0)
    if policy not in ("selective", "selective-alternate"):
        return PolicyOnly(Terms(), block_input)
    alternate = policy == "selective-alternate"
    # a post-norm's norms save their input's fp32 copy: in fp32, wo's and w2's outputs themselves
    post_saves_outputs = layer_of(m).norm_placement != "pre" and c == FP32
    released = _reduction(m, d, tp) + Terms(gathered=0 if alternate or post_saves_outputs else c * D)  # wo's
    if scores_kept(m, d):
        released += attention_kept(m, d, cp, policy)
    if _projections_unsaved(m, d):
        released += Terms(tp=c * (q_dim + (0 if alternate else kv_dim)))  # wq, wk outputs (before RoPE)
    if m.num_experts:
        # The recompute runs to the block's end (the load-balancing loss is saved after the output):
        # it consumes the router's logits and, when kept, the shared experts' w2 output.
        r = routing or balanced_routing(m)
        shared_w2 = m.num_shared_experts and policy_keeps_shared_output(m, r, policy)
        last = Terms(gathered=c * D if shared_w2 else 0)
        return PolicyOnly(released + Terms(gathered=c * m.num_experts) + _expert_parallel_released(m, d, r, policy)
                          + last, block_input, last)
    last = _reduction(m, d, tp)  # w2's / fc2's reduction, and w2's (fc2's) output unless recomputed
    if not (alternate and ungated_mlp(m)) and not post_saves_outputs:  # GPT-2's fc2 (6th) is not kept
        last += Terms(gathered=c * D)
    return PolicyOnly(released, block_input + last)


def _projections_unsaved(m: ModelConfig, d: ActDtypes) -> bool:
    """Whether the unwrapped block saves nothing of wq's and wk's outputs: they feed RoPE (which saves
    only its tables) or QK-norm's fp32 cast (a copy, unless they are fp32 already)."""
    a = layer_of(m).attention
    return a.rope and not (a.qk_norm and d.compute == FP32)


def _expert_parallel_released(m: ModelConfig, d: ActDtypes, r: Routing, policy: str) -> Terms:
    """Expert parallelism under the selective policies: kept tensors the unwrapped block does not save,
    so its recompute consumes them: the dispatch all-to-all's output (reordered by expert, or by
    expert and source) and the experts' w2 outputs the policy keeps (concatenated, or reordered by
    source, into the combine's input; on one rank the routing weights' product saves them)."""
    if r.ep == 1:
        return Terms()
    w2_kept = _kept_shares(m, policy, r)["experts_w2"]
    return Terms(gathered=r.rows * d.compute * m.dim * (1 + w2_kept))


def shared_experts_saved(m: ModelConfig, d: ActDtypes, policy: str) -> tuple[Terms, Terms]:
    """(kept by the policy, rebuilt by the recompute) of what the shared experts save: their
    backward runs before the routed experts' (their sum is the layer's last op), so by the routed
    experts' backward these are freed. The SwiGLU's 4 tensors (selective keeps the matmul outputs,
    w1 and w3, and recomputes silu and the product; selective-alternate keeps one of w1 and w3;
    full recomputes all four) and under autocast the casts of their input that w1 and w3 save
    (recomputed by every policy)."""
    if not m.num_shared_experts:
        return Terms(), Terms()
    saved = swiglu_saved(d.compute, m.num_shared_experts * m.expert_ffn_dim)
    casts = 2 * d.compute * m.dim if d.autocast else 0
    kept = {"none": saved, "selective": saved / 2, "selective-alternate": saved / 4}.get(policy, 0.0)
    return Terms(gathered=kept + (casts if policy == "none" else 0)), \
        Terms(gathered=saved - kept + (0 if policy == "none" else casts))
