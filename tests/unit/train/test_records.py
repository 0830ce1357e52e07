"""Fine-tuning records (train/records.py) and their preparation as samples (train/samples.py, train/data.py):
every format read, told apart, masked and split; bad records named with their file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainfit.config import ConfigError, DataConfig
from trainfit.train.data import eval_batches, load_prepared, prepare_data, resolve_data
from trainfit.train.records import read_records
from trainfit.train.samples import IGNORE, SampleSampler

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_each_format_becomes_a_conversation_or_a_text(tmp_path: Path) -> None:
    records = [
        *read_records(_write(tmp_path / "chat.jsonl", [CHAT])),
        *read_records(_write(tmp_path / "pc.jsonl", [{"prompt": "Q: ", "completion": "A"}])),
        *read_records(_write(tmp_path / "alpaca.jsonl", [{"instruction": "Add", "input": "2 2", "output": "4"}])),
        *read_records(_write(tmp_path / "conv.jsonl", [{"prompt": [{"role": "user", "content": "q"}],
                                                        "completion": [{"role": "assistant", "content": "a"}]}])),
        *read_records(_write(tmp_path / "text.jsonl", [{"text": "plain"}])),
    ]
    chat, pc, alpaca, conv, text = records
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] and chat.trained_from == 0
    assert (pc.text, pc.text_trained_from) == ("Q: A", 3)
    assert alpaca.messages == ({"role": "user", "content": "Add\n\n2 2"}, {"role": "assistant", "content": "4"})
    assert conv.trained_from == 1 and len(conv.messages) == 2
    assert text.text == "plain" and chat.where.endswith("chat.jsonl:1")
    as_json = tmp_path / "chat.json"
    as_json.write_text(json.dumps([CHAT, CHAT]))
    assert [r.where[-3:] for r in read_records(as_json)] == ["[0]", "[1]"]


BAD = {
    "no_fields": ([{"question": "?"}], "auto", "none of the formats' fields"),
    "mixed_in_a_file": ([CHAT, {"text": "t"}], "auto", r"b.jsonl:2.*lacks 'messages'"),
    "unknown_role": ([{"messages": [{"role": "bot", "content": "x"}]}], "auto", "role 'bot' is unknown"),
    "no_assistant": ([{"messages": [{"role": "user", "content": "x"}]}], "auto", "no assistant turn"),
    "content_not_string": ([{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]}],
                           "auto", "'content' is a int"),
    "prompt_types_differ": ([{"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}], "auto",
                            "both be strings or both be message lists"),
    "forced_format": ([CHAT], "alpaca", "lacks 'instruction', 'output' of the alpaca format"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_records_are_named_with_their_file_and_line(case: str, tmp_path: Path) -> None:
    records, fmt, message = BAD[case]
    with pytest.raises(ConfigError, match=message) as err:
        list(read_records(_write(tmp_path / "b.jsonl", records), fmt))
    assert "b.jsonl:" in str(err.value)
    not_json = tmp_path / "c.jsonl"
    not_json.write_text('{"messages": [}\n')
    with pytest.raises(ConfigError, match="c.jsonl:1.*not a UTF-8 JSON object"):
        list(read_records(not_json))


def _chat_folder(tmp_path: Path, n: int = 40) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    _write(folder / "a.jsonl", [{"messages": [{"role": "user", "content": f"question {i}"},
                                              {"role": "assistant", "content": "yes"}]} for i in range(n)])
    return folder


def test_prepared_samples_hold_ids_masks_and_whole_held_out_samples(tmp_path: Path) -> None:
    manifest = prepare_data(str(_chat_folder(tmp_path)), str(tmp_path / "out"), val_fraction=0.1,
                            chat_template="chatml")
    assert manifest["layout"] == "samples" and manifest["num_samples"] == {"train": 36, "val": 4}
    data = load_prepared(tmp_path / "out")
    assert data.samples and len(data.train) == 36
    first = bytes(np.asarray(data.train.ids[data.train.offsets[0]:data.train.offsets[1]], dtype=np.uint8)).decode()
    assert first == "<|im_start|>user\nquestion 0<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"
    inputs, targets, documents = data.train.row(np.asarray([0]), 128, pad_id=0)
    assert (documents[:len(first) - 1] == 0).all() and (documents[len(first) - 1:] == -1).all()
    trained = targets[targets != IGNORE]
    assert bytes(trained.astype(np.uint8)).decode() == "yes<|im_end|>"
    assert (inputs[len(first) - 1:] == 0).all() and (targets[len(first) - 1:] == IGNORE).all()
    assert data.manifest["trained_tokens"]["train"] == 36 * len("yes<|im_end|>")
    lengths = np.diff(data.train.offsets)
    stats = data.manifest["lengths"]["train"]
    assert stats["max"] == lengths.max()
    assert max(s["max"] for s in data.manifest["lengths"].values()) == manifest["longest_sample"]
    assert stats["sum_of_squares"] == int((lengths ** 2).sum()) and stats["mean"] == pytest.approx(lengths.mean())


def test_the_sampler_is_a_function_of_seed_and_step_and_cuts_long_samples(tmp_path: Path) -> None:
    prepare_data(str(_chat_folder(tmp_path)), str(tmp_path / "out"), chat_template="chatml")
    split = load_prepared(tmp_path / "out").train
    one = SampleSampler(split, 80, 4, seed=3, pad_id=0, grad_accum_steps=2)
    whole = [one.next_batch() for _ in range(4)]
    parts = [SampleSampler(split, 80, 2, seed=3, pad_id=0, rank=r, world_size=2, grad_accum_steps=2) for r in (0, 1)]
    for step in range(2):
        for micro in range(2):
            rows = [p.next_batch()[1] for p in parts]
            assert np.array_equal(np.concatenate(rows), whole[step * 2 + micro][1].numpy())
    resumed = SampleSampler(split, 80, 4, seed=3, pad_id=0, grad_accum_steps=2)
    resumed.load_state_dict(one.state_dict())
    assert resumed.position == 4
    # "yes" starts at the 62nd byte after a one-digit question, the 63rd after two: those keep a token, cut
    with pytest.warns(UserWarning, match="38 of 38 training samples are longer than .* 28 of them keep no token"):
        cut = SampleSampler(split, 60, 1, seed=0, pad_id=0)
    assert len(cut.usable) == 10 and all((cut.next_batch()[1] != IGNORE).sum() >= 1 for _ in range(5))


def test_no_sample_to_train_on_within_seq_len_is_a_named_error(tmp_path: Path) -> None:
    prepare_data(str(_chat_folder(tmp_path)), str(tmp_path / "out"), chat_template="chatml")
    split = load_prepared(tmp_path / "out").train
    with pytest.raises(ConfigError, match="training.seq_len=8: no sample has a token to train on"):
        SampleSampler(split, 8, 1, seed=0, pad_id=0)
    batches = list(eval_batches(load_prepared(tmp_path / "out").val, 80, 2, 3))
    assert len(batches) == 3 and batches[0][0].shape == (2, 80)


def test_a_run_prepares_chat_data_through_the_cache_once(tmp_path: Path) -> None:
    cfg = DataConfig(path=str(_chat_folder(tmp_path)), chat_template="chatml")
    first = resolve_data(cfg, str(tmp_path / "cache"))
    again = resolve_data(cfg, str(tmp_path / "cache"))
    assert first.samples and first.manifest == again.manifest
    everything = resolve_data(DataConfig(path=cfg.path, chat_template="chatml", loss_on="all"), str(tmp_path / "cache"))
    assert everything.manifest["trained_tokens"]["train"] > first.manifest["trained_tokens"]["train"]
    assert len(list((tmp_path / "cache").iterdir())) == 2
    with pytest.raises(ConfigError, match="found no chat template"):
        resolve_data(DataConfig(path=cfg.path), str(tmp_path / "cache2"))


def test_parquet_records_read_as_their_json_lines_do(tmp_path: Path) -> None:
    """A dataset hub's Parquet file (a messages column of structs, prompt/completion strings) streams in row
    groups into the same records, and prepares into the same samples, as the same rows in JSON Lines."""
    import pyarrow as pa  # the dev extra's, as trainfit[parquet]'s
    import pyarrow.parquet as pq

    from trainfit.train import records as records_module

    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "yes"}]}
            for i in range(40)]
    jsonl, parquet = tmp_path / "j" / "a.jsonl", tmp_path / "p" / "a.parquet"
    jsonl.parent.mkdir()
    parquet.parent.mkdir()
    _write(jsonl, rows)
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=16)
    original = records_module.PARQUET_BATCH_ROWS
    records_module.PARQUET_BATCH_ROWS = 7  # several reads a row group
    try:
        from_parquet = list(read_records(parquet))
    finally:
        records_module.PARQUET_BATCH_ROWS = original
    assert [r.messages for r in from_parquet] == [r.messages for r in read_records(jsonl)]
    assert from_parquet[17].where.endswith("a.parquet[row 17]")
    one = prepare_data(str(jsonl.parent), str(tmp_path / "out-j"), chat_template="chatml")
    two = prepare_data(str(parquet.parent), str(tmp_path / "out-p"), chat_template="chatml")
    assert one["sha256"] == two["sha256"] and one["num_samples"] == two["num_samples"]
    pq.write_table(pa.Table.from_pylist([{"question": "?"}]), tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match=r"bad.parquet\[row 0\]' has none of the formats' fields"):
        list(read_records(tmp_path / "bad.parquet"))
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        list(read_records(tmp_path / "fake.parquet"))


def test_longer_samples_are_dropped_when_asked(tmp_path: Path) -> None:
    prepare_data(str(_chat_folder(tmp_path)), str(tmp_path / "out"), chat_template="chatml")
    split = load_prepared(tmp_path / "out").train
    lengths = np.diff(split.offsets)
    shortest = int(lengths.min())  # one-digit questions; two-digit ones are a byte longer
    with pytest.warns(UserWarning, match=r"longer than training.seq_len \+ 1 = .* left out \(data.truncation=drop\)"):
        dropping = SampleSampler(split, shortest - 1, 1, seed=0, pad_id=0, truncation="drop")
    assert len(dropping.usable) == int((lengths == shortest).sum()) < len(split)
    cutting = SampleSampler(split, 80, 1, seed=0, pad_id=0, truncation="drop")  # every sample fits in 81
    assert len(cutting.usable) == len(split)
    with pytest.raises(ConfigError, match="data.truncation=drop"):
        SampleSampler(split, 20, 1, seed=0, pad_id=0, truncation="drop")
