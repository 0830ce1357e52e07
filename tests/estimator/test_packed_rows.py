"""How the estimators and the time model see fine-tuning rows (sample_rows.py): the samples' lengths read from
the prepared data without tokenizing it, attention priced from them (the sum of squares, not seq_len squared),
and on a GPU FlexAttention's block mask counted where the CPU's [B, 1, T, T] masks would be. The CPU's masks
themselves are checked against measured steps by the accuracy grid (accuracy_grid.PACKED_GRID)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from accuracy_grid import COMPONENT_FLOOR, component_gaps

from _analytic import memory_of
from _runs import run_config
from trainfit.hardware import device_type
from trainfit.models import block_cost as B
from trainfit.parallel.resolve import build_layout
from trainfit.perf import flops as F
from trainfit.perf import timing
from trainfit.perf.timing import estimate_perf
from trainfit.sample_rows import FLEX_BLOCK
from trainfit.traced import trace_step
from trainfit.train.data import prepare_data, resolve_data, sample_rows_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CHAT = Path(__file__).resolve().parents[1] / "data" / "chat"
SHAPE = ("--model.preset=debug", "--model.dim=128", "--model.ffn_dim=384", "--model.vocab_size=512",
         "--model.max_seq_len=512", "--training.seq_len=512", "--training.micro_batch_size=4",
         "--training.global_batch_size=4", "--data.chat_template=chatml")


def _prepared(tmp_path: Path) -> Path:
    out = tmp_path / "prepared"
    prepare_data(str(CHAT), str(out), chat_template="chatml")
    return out


def _lengths(prepared: Path) -> np.ndarray:
    return np.diff(np.fromfile(prepared / "train.idx", dtype=np.int64)).astype(np.float64)


def test_the_rows_come_from_the_prepared_samples_lengths(tmp_path: Path) -> None:
    prepared = _prepared(tmp_path)
    lengths = _lengths(prepared)
    cfg = run_config(tmp_path / "run", f"--data.path={prepared}", *SHAPE)
    rows = build_layout(cfg).rows
    assert rows is not None and rows.packed and rows.measured
    assert rows.effective_length == pytest.approx((lengths ** 2).sum() / lengths.sum())
    assert rows.mean_length == pytest.approx(lengths.mean())
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert rows.trained_fraction == pytest.approx(manifest["trained_tokens"]["train"] / lengths.sum())
    # the effective length is a length-weighted mean: above the plain mean, within the longest sample
    assert lengths.mean() < rows.effective_length <= lengths.max()
    assert rows.attended_length(512) == round(rows.effective_length)
    assert rows.attended_length(64) == 64  # samples cut at the row keep the row's positions
    padded = build_layout(run_config(tmp_path / "run", f"--data.path={prepared}", "--data.packing=false",
                                     *SHAPE)).rows
    assert padded is not None and not padded.packed and padded.attended_length(512) == 512


def test_records_are_priced_from_the_cache_once_a_run_tokenized_them(tmp_path: Path) -> None:
    cfg = run_config(tmp_path / "run", f"--data.path={CHAT}", *SHAPE)
    cache = tmp_path / "cache"
    before = sample_rows_of(cfg.data, cache_dir=str(cache))
    assert before is not None and before.packed and not before.measured  # records, not tokenized yet
    assert before.attended_length(512) == 512
    resolve_data(cfg.data, str(cache))  # what the trainer does at its start
    after = sample_rows_of(cfg.data, cache_dir=str(cache))
    assert after is not None and after.measured
    assert sample_rows_of(run_config(tmp_path / "text", *SHAPE).data) is None  # the packaged text: a stream
    text = tmp_path / "corpus.txt"
    text.write_text("plain text, not samples\n" * 50)
    assert sample_rows_of(run_config(tmp_path / "text", f"--data.path={text}", *SHAPE).data) is None


@pytest.mark.parametrize("gpu", ["H100-SXM-80GB", "cpu"])
def test_packed_attention_is_priced_from_the_samples_lengths(tmp_path: Path, gpu: str) -> None:
    prepared = _prepared(tmp_path)
    packed = run_config(tmp_path / "p", f"--data.path={prepared}", f"--hardware.gpu={gpu}", *SHAPE)
    padded = run_config(tmp_path / "q", f"--data.path={prepared}", f"--hardware.gpu={gpu}", "--data.packing=false",
                        *SHAPE)
    rows = build_layout(packed).rows
    assert rows is not None
    m, tokens = packed.model, 4 * 512
    effective = rows.attended_length(512)
    assert effective < 300  # samples of 70 to 330 tokens: far from the row's 512
    perf = {name: estimate_perf(m, build_layout(c), c.training, c.hardware).flops
            for name, c in (("packed", packed), ("padded", padded))}
    # model FLOPs: attention over each sample, not over the row
    assert perf["packed"]["model_flops_per_step"] == pytest.approx(tokens * F.training_flops_per_token(m, effective))
    assert perf["padded"]["model_flops_per_step"] == pytest.approx(tokens * F.training_flops_per_token(m, 512))
    # what the kernel computes: FlexAttention's blocks around each sample on a GPU; SDPA's explicit mask on the
    # CPU computes the whole row, both triangles
    forward = {name: timing._rank_flops(m, build_layout(c), c.training, device_type(c.hardware)).forward
               for name, c in (("packed", packed), ("padded", padded))}
    saved = forward["padded"] - forward["packed"]
    layers = m.num_layers
    if gpu == "H100-SXM-80GB":
        expected = B.block_attention_flops(m, 512) - B.block_attention_flops(m, effective + FLEX_BLOCK)
    else:
        expected = B.block_attention_flops(m, 512) - B.block_attention_flops(m, 512, causal=False)
    assert saved == pytest.approx(tokens * layers * expected, rel=1e-6)


def test_on_a_gpu_the_block_mask_replaces_the_cpus_whole_masks(tmp_path: Path) -> None:
    """The CUDA form keeps FlexAttention's block mask (a few KiB), where the CPU's keeps a [B, 1, T, T] mask:
    the analytic estimate agrees with the traced step of each (traced.py runs the CUDA form's stand-in)."""
    prepared = _prepared(tmp_path)
    peaks = {}
    for gpu in ("H100-SXM-80GB", "cpu"):
        cfg = run_config(tmp_path / gpu, f"--data.path={prepared}", f"--hardware.gpu={gpu}", "--training.device=cpu",
                         "--precision.mode=bf16-mixed", *SHAPE)
        analytic, traced = memory_of(cfg).worst, trace_step(cfg).per_stage[0]
        gaps = {k: gap for k, gap in component_gaps(analytic, traced, COMPONENT_FLOOR).items() if abs(gap[0]) > gap[1]}
        assert not gaps, (gpu, gaps)
        peaks[gpu] = analytic.activations
    mask = 4 * 512 * 512 * 2  # one window (the layers' full causal one), bf16
    assert peaks["cpu"] - peaks["H100-SXM-80GB"] == pytest.approx(mask, rel=0.05)
