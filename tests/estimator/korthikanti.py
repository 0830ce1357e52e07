"""Korthikanti et al.'s activation bytes of a GPT-3 layer (arXiv 2205.05198, Sec. 4), term by term as
the paper derives them: the published reference tests/estimator/ compares our block counts with. Torch-free."""

from __future__ import annotations


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one GPT-3 transformer layer in 16-bit (Korthikanti et al., "Reducing
    Activation Recomputation in Large Transformer Models", arXiv 2205.05198, Sec. 4), summed term
    by term as the paper derives it: s sequence, b micro-batch, h hidden, a heads, t tensor-parallel.

    Without recomputation: sbh(34 + 5as/h); with tensor parallelism only the attention and MLP
    internals shrink: sbh(10 + 24/t + 5as/(ht)); with sequence parallelism too, everything /t.
    Selective recomputation (of the attention core) drops the 5as/h term; full keeps the layer
    input, 2sbh (/t with sequence parallelism).
    """
    sbh = s * b * h
    # (bytes per sbh, divided by t under TP alone?) -- Sec. 4.1 and 4.2.
    attention = [
        (2, False),  # QKV matmul input
        (4, True),  # Q and K for QK^T
        (2, True),  # V
        (2, True),  # input of the output projection (attention output)
        (1, False),  # attention dropout mask
    ]
    attention_core = 5 * a * s / h  # softmax output 2as^2b, its dropout mask as^2b, dropout output 2as^2b
    mlp = [(2, False), (8, True), (8, True), (1, False)]  # fc1 input, fc1 out (GELU in), GELU out, dropout mask
    norms = [(2, False), (2, False)]  # the two LayerNorm inputs
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    per_layer = 0.0
    for coef, parallel in attention + mlp + norms:
        per_layer += coef / t if (parallel or sequence_parallel) else coef
    if recompute != "selective":
        per_layer += attention_core / t
    return sbh * per_layer
