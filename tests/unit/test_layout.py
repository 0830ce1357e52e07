"""The one Layout: built once from (config, world size), validated with named errors, never
writing into the config; pure (no torch, no process group)."""

from __future__ import annotations

import copy
import re

import pytest

from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.parallel.resolve import build_layout, launch_command, nearest, resolve_world_size
from trainfit.parallel.tensor_parallel import uneven_vocabulary


def layout_of(*overrides: str, world_size: int | None = None):
    cfg = load_config(None, list(overrides))
    return build_layout(cfg, world_size)


def test_degrees_are_derived_without_touching_the_config() -> None:
    cfg = load_config(None, ["--hardware.num_gpus=64", "--parallel.tp=4", "--parallel.pp=2", "--parallel.zero_stage=3",
                             "--training.global_batch_size=64", "--training.micro_batch_size=1"])
    before = copy.deepcopy(cfg)
    layout = build_layout(cfg)
    assert (layout.dp_replicate, layout.dp_shard, layout.dp, layout.zero_shards) == (1, 8, 8, 8)
    assert (layout.grad_accum_steps, layout.num_microbatches, layout.world_size) == (8, 8, 64)
    assert layout.data_parallel == "fsdp"
    assert cfg == before and cfg.parallel.dp_shard == -1  # what the user wrote stays

    hsdp = layout_of("--hardware.num_gpus=16", "--parallel.dp_replicate=2", "--training.global_batch_size=32",
                     "--training.micro_batch_size=2", "--parallel.zero_stage=3")
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.grad_accum_steps) == (2, 8, 1)
    assert hsdp.mesh_axes() == {"dp_replicate": 2, "dp_shard": 8}


def test_accumulation_and_the_data_parallel_kind() -> None:
    assert layout_of("--training.micro_batch_size=4", "--training.global_batch_size=32").grad_accum_steps == 8
    one = layout_of("--parallel.zero_stage=3")
    assert one.data_parallel == "none" and one.ineffective_options() == [
        "parallel.zero_stage=3 has no effect: one data-parallel rank holds every shard"]
    offloaded = layout_of("--parallel.zero_stage=3", "--memory.offload=optimizer+params")
    assert offloaded.data_parallel == "fsdp" and not offloaded.ineffective_options()  # FSDP2 on one rank
    assert layout_of("--hardware.num_gpus=4", "--training.micro_batch_size=4").data_parallel == "ddp"
    zero1 = layout_of("--hardware.num_gpus=4", "--training.micro_batch_size=4", "--parallel.zero_stage=1")
    assert zero1.data_parallel == "zero1" and zero1.grad_accum_dtype == "param"


def test_fp32_gradient_accumulation_is_zero1s_in_16_bits() -> None:
    four = ("--hardware.num_gpus=4", "--training.micro_batch_size=4", "--optimizer.grad_accum_dtype=fp32")
    mixed = layout_of(*four, "--parallel.zero_stage=1", "--precision.mode=bf16-mixed")
    assert mixed.grad_accum_dtype == "fp32" and not mixed.ineffective_options()
    for ineffective in (layout_of(*four, "--parallel.zero_stage=3", "--precision.mode=bf16-mixed"),
                        layout_of(*four, "--parallel.zero_stage=1")):  # fp32 already
        assert ineffective.ineffective_options() == [
            "optimizer.grad_accum_dtype='fp32' has no effect: only ZeRO-1 (parallel.zero_stage=1 on several ranks) "
            "in 16-bit precision accumulates gradients in a dtype of its own"]
    with pytest.raises(ConfigError, match=re.escape("optimizer.grad_accum_dtype='bf16': choose one of param | fp32")):
        load_config(None, ["--optimizer.grad_accum_dtype=bf16"])


def test_the_same_config_lays_out_on_any_world() -> None:
    cfg = load_config(None, ["--parallel.zero_stage=3", "--training.micro_batch_size=2",
                             "--training.global_batch_size=16"])
    assert [(lay.dp_shard, lay.grad_accum_steps) for lay in (build_layout(cfg, n) for n in (1, 2, 4, 8))] == [
        (1, 8), (2, 4), (4, 2), (8, 1)]


@pytest.mark.parametrize(("overrides", "expected"), [
    (["--training.global_batch_size=20"], "training.global_batch_size=20: must be a multiple of micro_batch_size x "
     "data-parallel degree = 16 x 1 = 16; try 16 or 32, or training.micro_batch_size=20"),
    (["--parallel.tp=3"], "parallel.tp=3: must divide model.num_heads=8 (each rank holds whole heads); try 2 or 4"),
    (["--hardware.num_gpus=8", "--parallel.pp=8"], "parallel.pp=8: pp x pp_virtual_stages = 8 x 1 = 8 stages for "
     "model.num_layers=4 blocks (the derived split gives each stage one, but the last, which may hold the head "
     "alone); try pp=4 or 5, or set parallel.pp_layers_per_stage (stages after the first may hold no block)"),
    (["--hardware.num_gpus=2", "--parallel.pp=2", "--parallel.pp_layers_per_stage=1,2"], "parallel.pp_layers_per_stage="
     "[1, 2]: give 2 entries (pp x pp_virtual_stages = 2 x 1) summing to model.num_layers=4"),
    (["--hardware.num_gpus=2", "--parallel.pp=2", "--parallel.pp_schedule=zbv-zero-bubble",
      "--parallel.pp_virtual_stages=3"], "zbv-zero-bubble runs exactly two stages per rank (a V); set it to 2 or 0"),
    (["--hardware.num_gpus=2", "--parallel.pp=2", "--parallel.num_microbatches=3"], "parallel.num_microbatches=3: "
     "must divide the 16 sequences each data-parallel rank runs per step"),
    (["--hardware.num_gpus=4", "--parallel.pp=4", "--parallel.num_microbatches=2"], "parallel.num_microbatches=2: "
     "fewer micro-batches than the 4 pipeline ranks leaves one idle the whole step; try 4"),
    (["--hardware.num_gpus=2", "--parallel.pp=2", "--parallel.pp_schedule=dualpipev", "--parallel.num_microbatches=2",
      "--model.num_layers=4"], "parallel.num_microbatches=2: dualpipev needs at least one micro-batch per stage (4)"),
    (["--hardware.num_gpus=4", "--parallel.pp=4", "--training.global_batch_size=2", "--training.micro_batch_size=1"],
     "training.global_batch_size=2: each of the 1 data-parallel ranks runs 2 sequences per step, fewer than the 4 "
     "micro-batches parallel.pp_schedule='1f1b' needs on 4 pipeline ranks; set it to at least 4"),
    (["--parallel.tp=2"], "hardware.num_gpus=1: must be a multiple of tp x pp x cp = 2 x 1 x 1 = 2"),
    (["--hardware.num_gpus=8", "--parallel.dp_shard=3"],
     "parallel.dp_shard=3: dp_replicate x dp_shard must equal num_gpus / (tp x pp x cp) = 8; set dp_shard=8"),
    (["--hardware.num_gpus=8", "--parallel.dp_replicate=3"], "parallel.dp_replicate=3: must divide the "
     "data-parallel degree num_gpus / (tp x pp x cp) = 8; try 2 or 4"),
    (["--parallel.ep=2"], "parallel.ep=2: expert parallelism needs an MoE model"),
    (["--model.preset=debug-moe", "--hardware.num_gpus=8", "--parallel.ep=3", "--training.micro_batch_size=2"],
     "parallel.ep=3: must divide model.num_experts=4; try 2 or 4"),
    (["--hardware.num_gpus=2", "--parallel.cp=2", "--training.seq_len=126"], "parallel.cp=2: 2 x cp must divide"),
    (["--hardware.num_gpus=2", "--parallel.pp=2", "--parallel.pp_virtual_stages=2"],
     "1f1b runs one stage per rank; set it to 1 or 0, or use parallel.pp_schedule='interleaved-1f1b'"),
    (["--memory.offload=optimizer", "--parallel.zero_stage=1"], "set parallel.zero_stage=2 or 3"),
    (["--memory.offload=optimizer+params", "--parallel.zero_stage=2"], "only under parallel.zero_stage=3"),
    (["--hardware.num_gpus=4", "--parallel.dp_replicate=4", "--parallel.zero_stage=3", "--training.micro_batch_size=4"],
     "parallel.zero_stage=3: ZeRO shards over dp_shard, which is 1 here"),
])
def test_impossible_layouts_name_the_field_the_value_and_the_nearest_valid_ones(overrides: list[str],
                                                                                 expected: str) -> None:
    cfg = load_config(None, overrides)  # each field is valid on its own; the combination is not
    with pytest.raises(ConfigError) as err:
        build_layout(cfg)
    assert expected in str(err.value)


def test_what_train_cannot_run_yet_is_said_apart() -> None:
    assert layout_of().untrainable_reason() is None
    assert layout_of("--memory.chunked_loss=true").untrainable_reason() is None
    compiled_tp = ("--hardware.num_gpus=2", "--parallel.tp=2", "--training.compile=true")
    assert layout_of(*compiled_tp, "--memory.activation_checkpointing=selective").untrainable_reason() is None
    recomputed_rng = layout_of(*compiled_tp, "--memory.activation_checkpointing=full").untrainable_reason()
    assert "use memory.activation_checkpointing='selective'" in recomputed_rng
    assert layout_of("--hardware.num_gpus=2", "--parallel.pp=2", "--training.compile=true").untrainable_reason() is None
    assert layout_of("--hardware.num_gpus=2", "--parallel.pp=2").untrainable_reason() is None
    pp_ddp = layout_of("--hardware.num_gpus=4", "--parallel.pp=2", "--training.micro_batch_size=8")
    assert pp_ddp.untrainable_reason() == (
        "parallel.zero_stage=0 with parallel.pp=2 and 2 data-parallel ranks: pipeline stages compose with FSDP2's "
        "data parallelism only; set parallel.zero_stage=2 or 3")
    assert layout_of("--hardware.num_gpus=2", "--parallel.tp=2").untrainable_reason() is None
    tp_ddp = layout_of("--hardware.num_gpus=4", "--parallel.tp=2", "--parallel.cp=2")
    assert tp_ddp.untrainable_reason() == (
        "parallel.zero_stage=0 with parallel.tp=2 and 1 data-parallel x 2 context-parallel ranks: tensor parallelism "
        "composes with FSDP2's data parallelism only; set parallel.zero_stage=2 or 3")
    fp16 = layout_of("--hardware.num_gpus=2", "--parallel.tp=2", "--precision.mode=fp16-mixed")
    assert "fp16 loss scaling is not built for tensor-parallel gradients yet" in fp16.untrainable_reason()


@pytest.mark.parametrize("schedule", ["interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev"])
def test_selective_checkpointing_and_split_backward_are_said_apart(schedule: str) -> None:
    """torch's selective checkpointing refuses a second backward through a region (seen on gloo),
    and these schedules run the input and the weight gradients apart; full checkpointing trains."""
    pp = ("--hardware.num_gpus=2", "--parallel.pp=2", f"--parallel.pp_schedule={schedule}", "--model.num_layers=4",
          "--training.micro_batch_size=2", "--training.global_batch_size=8")
    full = layout_of(*pp, "--memory.activation_checkpointing=full")
    assert full.untrainable_reason() is None
    assert any(o.startswith("memory.activation_checkpointing='full' under parallel.pp_schedule=") and
               "saves no memory" in o for o in full.ineffective_options())
    for policy in ("selective", "selective-alternate"):
        reason = layout_of(*pp, f"--memory.activation_checkpointing={policy}").untrainable_reason()
        assert reason.startswith(f"memory.activation_checkpointing={policy!r} with parallel.pp_schedule={schedule!r}")
        assert "use activation_checkpointing='full' or 'none'" in reason
    assert layout_of(*pp[:2], "--parallel.pp_schedule=1f1b", "--model.num_layers=4",
                     "--memory.activation_checkpointing=selective").untrainable_reason() is None


def test_expert_parallel_trains_under_fsdp2_only() -> None:
    moe = ("--model.preset=debug-moe", "--parallel.ep=2", "--training.micro_batch_size=2")
    assert layout_of(*moe, "--hardware.num_gpus=2", "--parallel.zero_stage=3").untrainable_reason() is None
    assert layout_of(*moe, "--hardware.num_gpus=2", "--parallel.cp=2", "--parallel.zero_stage=2",
                     ).untrainable_reason() is None
    for stage in (0, 1):
        reason = layout_of(*moe, "--hardware.num_gpus=2", f"--parallel.zero_stage={stage}").untrainable_reason()
        assert reason.startswith(f"parallel.zero_stage={stage} with parallel.ep=2: expert parallelism composes with "
                                 "FSDP2's data parallelism only")
        assert reason.endswith("set parallel.zero_stage=2 or 3")
    tp = layout_of(*moe, "--hardware.num_gpus=4", "--parallel.tp=2", "--parallel.zero_stage=3")
    assert tp.untrainable_reason().startswith("parallel.ep=2 with parallel.tp=2: not built with tensor parallelism")
    hsdp = layout_of(*moe, "--hardware.num_gpus=4", "--parallel.dp_replicate=2", "--parallel.zero_stage=3")
    assert "set parallel.dp_replicate=1 (dp_shard=4" in hsdp.untrainable_reason()


def test_adafactor_trains_on_whole_parameters_only() -> None:
    """Its factored statistics span whole rows and columns: one process, DDP, context parallelism and
    pipeline stages keep parameters whole; ZeRO-1 shards its states by rows, and FSDP2 (on one rank
    too, under CPU offload) and tensor parallelism make the parameters DTensors, on which torch's
    Adafactor fails."""
    af = ("--optimizer.name=adafactor", "--training.micro_batch_size=2")
    for whole in ((), ("--hardware.num_gpus=2",), ("--hardware.num_gpus=2", "--parallel.cp=2"),
                  ("--hardware.num_gpus=2", "--parallel.pp=2", "--training.global_batch_size=4"),
                  ("--parallel.zero_stage=3",)):  # one rank: nothing to shard
        assert layout_of(*af, *whole).untrainable_reason() is None, whole
    assert layout_of(*af, "--hardware.num_gpus=2", "--parallel.zero_stage=1").untrainable_reason() == (
        "optimizer.name='adafactor' with parallel.zero_stage=1 on 2 ranks: Adafactor's factored statistics span "
        "whole parameters, and ZeRO-1 shards its states by rows; set parallel.zero_stage=0, or use another optimizer")
    for sharded, named in ((("--hardware.num_gpus=2", "--parallel.zero_stage=2"), "parallel.zero_stage=2 on 2 ranks"),
                           (("--hardware.num_gpus=4", "--parallel.cp=2", "--parallel.zero_stage=3"),
                            "parallel.zero_stage=3 on 4 ranks"),
                           (("--parallel.zero_stage=2", "--memory.offload=optimizer"), "memory.offload='optimizer'"),
                           (("--hardware.num_gpus=2", "--parallel.tp=2"), "parallel.tp=2")):
        reason = layout_of(*af, *sharded).untrainable_reason()
        assert reason.startswith(f"optimizer.name='adafactor' with {named}: the parameters are sharded "
                                 "DTensors"), reason
        assert reason.endswith("set parallel.zero_stage=0, parallel.tp=1 and memory.offload='none', or use another "
                               "optimizer")
    for other in ("adamw", "adam", "sgd", "adamw-8bit"):
        assert layout_of(f"--optimizer.name={other}", "--hardware.num_gpus=2", "--parallel.zero_stage=1"
                         ).untrainable_reason() is None


def test_tied_embeddings_do_not_split_over_pipeline_stages() -> None:
    tied = ("--model.preset=debug-gpt2", "--hardware.num_gpus=2", "--parallel.pp=2", "--training.micro_batch_size=2",
            "--training.global_batch_size=4")
    assert layout_of(*tied).untrainable_reason().startswith(
        "model.tie_embeddings=True with parallel.pp=2: the embedding lives on the first stage and the output "
        "projection on the last")
    assert layout_of(*tied, "--model.tie_embeddings=false").untrainable_reason() is None
    assert layout_of("--model.preset=debug-gpt2").untrainable_reason() is None


def test_context_parallel_ranks_shard_the_model_states_and_average_gradients() -> None:
    """torchtitan and Megatron shard over dp_shard x cp: the cp ranks hold the same parameters."""
    cp = layout_of("--hardware.num_gpus=8", "--parallel.cp=2", "--parallel.zero_stage=3")
    assert (cp.dp, cp.dp_shard, cp.zero_shards) == (4, 4, 8)
    only_cp = layout_of("--hardware.num_gpus=2", "--parallel.cp=2")
    assert only_cp.dp == 1 and only_cp.data_parallel == "ddp"  # gradients averaged over the 2 cp ranks
    assert layout_of("--hardware.num_gpus=2", "--parallel.cp=2", "--parallel.zero_stage=3").zero_shards == 2
    assert layout_of("--parallel.sequence_parallel=true").ineffective_options() == [
        "parallel.sequence_parallel=true has no effect: it shards along the sequence what tensor parallelism leaves "
        "whole, and parallel.tp=1"]


def test_the_launchers_world_size_is_resolved_once() -> None:
    cfg = load_config(None, ["--parallel.zero_stage=3"])
    assert resolve_world_size(cfg, None) == 1 and resolve_world_size(cfg, 4) == 4
    derived = build_layout(cfg, 4)  # no global batch given: 16 sequences per rank, no accumulation
    assert (derived.global_batch_size, derived.grad_accum_steps, build_layout(cfg, 1).global_batch_size) == (64, 1, 16)
    given = load_config(None, ["--parallel.zero_stage=3", "--training.global_batch_size=16"])
    with pytest.raises(ConfigError, match="16 x 4 = 64; try 64, or training.micro_batch_size=4"):
        build_layout(given, 4)  # 16 sequences a step cannot be 16 per rank on 4 ranks
    small = load_config(None, ["--parallel.zero_stage=3", "--training.micro_batch_size=4"])
    assert build_layout(small, 4).dp_shard == 4 and small.hardware.num_gpus == 1
    named = load_config(None, ["--hardware.num_gpus=8", "--training.micro_batch_size=1"])
    assert resolve_world_size(named, 8) == 8
    with pytest.raises(ConfigError, match="the launcher started 2 processes"):
        resolve_world_size(named, 2)
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node=8 -m trainfit"):
        resolve_world_size(named, 1)
    assert launch_command(16, 8).startswith("torchrun --nnodes=2 --nproc_per_node=8")


def test_nearest_valid_values() -> None:
    assert nearest(3, [1, 2, 4, 8]) == "2 or 4"
    assert nearest(12, [1, 2, 4, 8]) == "4 or 8"
    assert nearest(5, [5]) == "5"


def test_an_uneven_vocabulary_is_named_with_its_largest_shard_and_the_even_size() -> None:
    assert uneven_vocabulary(512, 2) is None and uneven_vocabulary(511, 1) is None
    note = uneven_vocabulary(50257, 4)  # GPT-2's vocabulary on 4 tensor-parallel ranks
    assert note is not None and "model.vocab_size=50257" in note and "12565 on the first ranks" in note
    assert "model.vocab_size=50260" in note


def test_pipeline_stages_split_the_blocks_by_compute_and_parameters() -> None:
    """The default split (parallel/stage_split.py): Llama 3.1 405B's 126 blocks on 16 stages give the
    first and last stage a block less (the embedding and the output projection each weigh ~0.65 of
    a block), the others 8; a small-vocabulary model splits evenly."""
    big = layout_of("--model.preset=llama3.1-405b", "--hardware.num_gpus=128", "--parallel.tp=8", "--parallel.pp=16",
                    "--training.micro_batch_size=1", "--training.global_batch_size=16", "--training.seq_len=8192")
    assert big.pp_layers == (7, *[8] * 14, 7) and big.num_microbatches == 16
    assert big.rank_blocks(0) == tuple(range(7)) and big.rank_blocks(15) == tuple(range(119, 126))
    even = layout_of("--hardware.num_gpus=2", "--parallel.pp=2", "--model.num_layers=8", "--model.vocab_size=64")
    assert even.pp_layers == (4, 4)
    given = layout_of("--hardware.num_gpus=4", "--parallel.pp=4", "--model.num_layers=6",
                      "--parallel.pp_layers_per_stage=1,2,2,1")
    assert given.pp_layers == (1, 2, 2, 1) and given.busiest_rank_blocks() == 2


def test_schedules_place_their_stages_on_the_ranks() -> None:
    """Looped schedules: rank r runs stages r, r + pp, ...; V schedules r and 2 pp - 1 - r; the
    micro-batch count is derived from the accumulation, raised to at least pp."""
    looped = layout_of("--hardware.num_gpus=4", "--parallel.pp=4", "--parallel.pp_schedule=interleaved-1f1b",
                       "--model.num_layers=8", "--training.micro_batch_size=2", "--training.global_batch_size=16")
    assert looped.pp_virtual_stages == 2 and looped.rank_stages(1) == (1, 5) and looped.num_stages == 8
    assert (looped.num_microbatches, looped.micro_batch_size) == (8, 2)  # the accumulation's 8 micro-batches
    v = layout_of("--hardware.num_gpus=4", "--parallel.pp=4", "--parallel.pp_schedule=dualpipev",
                  "--model.num_layers=8")
    assert v.rank_stages(0) == (0, 7) and v.rank_stages(3) == (3, 4) and v.rank_blocks(0) == (0, 7)
    assert (v.num_microbatches, v.micro_batch_size) == (8, 2)  # 16 rows: one micro-batch per stage at least
    assert layout_of("--hardware.num_gpus=4", "--parallel.pp=2", "--parallel.zero_stage=3", "--model.num_layers=4",
                     "--parallel.pp_schedule=zbv-zero-bubble").ineffective_options() == [
        "parallel.zero_stage=3 keeps the parameters whole from forward to backward (as ZeRO-2) under "
        "parallel.pp_schedule='zbv-zero-bubble': its split backward needs them unsharded (FSDP2's "
        "reshard_after_forward=False)"]


def test_a_chunked_loss_of_one_chunk_is_reported_with_the_numbers() -> None:
    """A rank's loss scores micro_batch_size x seq_len / cp tokens; a chunk of at least that many is
    the whole logits (tensor parallelism's ranks score every token, so tp changes nothing)."""
    micro = ("--memory.chunked_loss=true", "--training.micro_batch_size=8", "--training.seq_len=256",
             "--model.max_seq_len=256")
    one = layout_of(*micro, "--memory.loss_chunk_tokens=2048")
    assert (one.loss_tokens, one.loss_chunks) == (2048, 1)
    assert one.ineffective_options() == [
        "memory.chunked_loss=true saves no memory: memory.loss_chunk_tokens=2048 >= the 2048 tokens of a "
        "micro-batch that a rank's loss scores (8 sequences x 256 tokens), so one chunk holds the whole logits (and "
        "is recomputed in backward); set memory.loss_chunk_tokens below 2048, e.g. 512, or memory.chunked_loss=false"]
    split = layout_of(*micro, "--memory.loss_chunk_tokens=2047")
    assert split.loss_chunks == 2 and split.ineffective_options() == []
    assert layout_of(*micro[1:], "--memory.loss_chunk_tokens=4096").ineffective_options() == []  # not chunked
    cp = layout_of(*micro, "--hardware.num_gpus=4", "--parallel.cp=2", "--parallel.tp=2",
                   "--parallel.sequence_parallel=true", "--parallel.zero_stage=3")
    assert (cp.loss_tokens, cp.loss_chunk_tokens) == (1024, 1024)
    assert [o for o in cp.ineffective_options() if "chunked" in o] == [
        "memory.chunked_loss=true saves no memory: memory.loss_chunk_tokens=1024 >= the 1024 tokens of a "
        "micro-batch that a rank's loss scores (8 sequences x 256 tokens / cp=2), so one chunk holds the whole "
        "logits (and is recomputed in backward); set memory.loss_chunk_tokens below 1024, e.g. 256, or "
        "memory.chunked_loss=false"]
    piped = layout_of(*micro, "--hardware.num_gpus=2", "--parallel.pp=2", "--parallel.num_microbatches=4",
                      "--memory.loss_chunk_tokens=512")  # a pipeline micro-batch: 2 of the step's 8 sequences
    assert (piped.micro_batch_size, piped.loss_tokens, piped.ineffective_options()) == (2, 512, [
        "memory.chunked_loss=true saves no memory: memory.loss_chunk_tokens=512 >= the 512 tokens of a micro-batch "
        "that a rank's loss scores (2 sequences x 256 tokens), so one chunk holds the whole logits (and is "
        "recomputed in backward); set memory.loss_chunk_tokens below 512, e.g. 128, or memory.chunked_loss=false"])


@pytest.mark.parametrize("schedule", ["zbv-zero-bubble", "dualpipev", "interleaved-1f1b"])
def test_a_pipeline_schedule_without_pipeline_parallelism_places_the_one_stage(schedule: str) -> None:
    """pp=1 with a V schedule named (its two stages per rank need pp > 1): the model is one stage on the
    one rank; estimate and plan used to fail there (IndexError)."""
    from trainfit.estimate import estimate

    cfg = load_config(None, ["--model.preset=debug", f"--parallel.pp_schedule={schedule}"])
    layout = build_layout(cfg, 1)
    assert layout.rank_blocks(0) == tuple(range(cfg.model.num_layers)) and layout.stage_owners() == (0,)
    assert estimate(cfg, layout).memory.per_stage[0].peak > 0


def test_the_last_stage_may_hold_the_head_alone() -> None:
    """One stage more than blocks: the derived split leaves the head alone on the last (as nanotron's does),
    and never a stage without blocks between the ends (only parallel.pp_layers_per_stage gives those)."""
    base = ["--model.preset=debug", "--training.seq_len=32", "--hardware.num_gpus=3", "--parallel.pp=3",
            "--training.global_batch_size=8", "--training.micro_batch_size=1"]
    layout = build_layout(load_config(None, base))
    assert layout.pp_layers == (1, 1, 0)
    assert {(blocks, last) for blocks, _, last in layout.rank_shapes()} == {(1, False), (0, True)}


def test_stages_after_the_first_may_hold_no_block() -> None:
    """nanotron's compute-balanced split of 16 layers over pp8 leaves rank 6 nothing and rank 7 the head
    alone: given as parallel.pp_layers_per_stage, it lays out so. The first stage keeps a block (its
    embedding alone is refused, naming the field)."""
    split = "3,3,2,3,2,3,0,0"
    layout = layout_of("--model.preset=debug", "--model.num_layers=16", "--hardware.num_gpus=8", "--parallel.pp=8",
                       f"--parallel.pp_layers_per_stage={split}", "--training.global_batch_size=8",
                       "--training.micro_batch_size=1")
    assert layout.pp_layers == (3, 3, 2, 3, 2, 3, 0, 0)
    passing, head = layout.rank_placement(6), layout.rank_placement(7)
    assert (passing.blocks, passing.first, passing.last, passing.sends_next, passing.sends_prev) == ((), False, False,
                                                                                                   1, 1)
    assert (head.blocks, head.last) == ((), True)
    with pytest.raises(ConfigError, match=re.escape(
            "parallel.pp_layers_per_stage=[0, 1, 1]: the first stage (the embedding's) needs at least one block, "
            "the others at least 0")):
        load_config(None, ["--model.preset=debug", "--hardware.num_gpus=3", "--parallel.pp=3",
                           "--parallel.pp_layers_per_stage=0,1,1"])
    with pytest.raises(ConfigError, match=re.escape("parallel.pp_layers_per_stage=[1, -1, 2]")):
        load_config(None, ["--model.preset=debug", "--hardware.num_gpus=3", "--parallel.pp=3",
                           "--parallel.pp_layers_per_stage=1,-1,2"])
