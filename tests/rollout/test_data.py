import json

import pytest
from miles.rollout.data import FileSource, ReasoningGymSource

TASK_KWARGS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",))


def _source(seed=1, size=5):
    return ReasoningGymSource("basic_arithmetic", size=size, seed=seed, task_kwargs=TASK_KWARGS, prompt_suffix=" !")


def test_reasoning_gym_prompts_are_chat_messages_with_the_suffix_and_the_entry_as_label():
    prompt = _source().next_prompts(1)[0]
    assert prompt.prompt[-1]["role"] == "user" and prompt.prompt[-1]["content"].endswith(" !")
    assert prompt.prompt[-1]["content"].startswith(prompt.label["question"])


def test_an_epoch_serves_every_entry_once_and_the_next_epoch_reshuffles():
    source = _source(size=5)
    first = [p.metadata["data_index"] for p in source.next_prompts(5)]
    second = [p.metadata["data_index"] for p in source.next_prompts(5)]
    assert sorted(first) == sorted(second) == list(range(5))
    assert source.epoch == 1
    assert [p.group_index for p in source.next_prompts(2)] == [10, 11]


def test_resuming_from_state_dict_continues_with_the_same_prompts():
    source = _source(size=5)
    source.next_prompts(7)
    state = source.state_dict()
    expected = [p.prompt for p in source.next_prompts(6)]
    resumed = _source(size=5)
    resumed.load_state_dict(state)
    assert [p.prompt for p in resumed.next_prompts(6)] == expected


def test_an_unknown_task_names_the_config_key():
    with pytest.raises(ValueError, match="data.task 'no_such_task'"):
        ReasoningGymSource("no_such_task", size=2, seed=0)


def test_file_source_reads_gsm8k_questions_and_answers(gsm8k_test_file):
    source = FileSource(gsm8k_test_file, limit=10, seed=0)
    prompts = source.next_prompts(10)
    assert source.size == 10
    assert all(p.label.rsplit("####", 1)[1].strip() for p in prompts)
    assert sorted(p.metadata["data_index"] for p in prompts) == list(range(10))


def test_file_source_names_a_missing_column(gsm8k_test_file):
    with pytest.raises(ValueError, match="data.prompt_key is 'problem'"):
        FileSource(gsm8k_test_file, prompt_key="problem")


def test_file_source_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path"):
        FileSource(tmp_path / "missing.jsonl")


def test_file_source_reads_a_saved_hf_dataset_directory_with_the_same_rows_as_its_jsonl(tmp_path):
    import datasets

    rows = [{"q": f"What is {i} + {i}?", "a": str(2 * i), "extra": i} for i in range(5)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    from_jsonl = FileSource(tmp_path / "rows.jsonl", prompt_key="q", label_key="a", seed=3)
    from_disk = FileSource(tmp_path / "saved", prompt_key="q", label_key="a", seed=3)
    assert from_disk.size == 5
    assert [(p.prompt, p.label) for p in from_disk.next_prompts(5)] == [
        (p.prompt, p.label) for p in from_jsonl.next_prompts(5)
    ]


def test_a_saved_dataset_dict_names_its_splits_and_a_plain_directory_is_refused(tmp_path):
    import datasets

    split = datasets.Dataset.from_list([{"question": "1 + 1?", "answer": "2"}])
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"is a DatasetDict with splits \['test', 'train'\]; point at one split"):
        FileSource(tmp_path / "dd", seed=0)
    assert FileSource(tmp_path / "dd" / "test", seed=0).size == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="is a directory but no HF dataset"):
        FileSource(tmp_path / "empty", seed=0)


def _write_rows(tmp_path, rows):
    """The same rows as ``rows.jsonl`` and ``rows.parquet`` (written with pyarrow) in ``tmp_path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    return tmp_path / "rows.jsonl", tmp_path / "rows.parquet"


def test_file_source_reads_a_parquet_file_with_the_same_rows_as_its_jsonl(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "final": f"#### {2 * i}"} for i in range(5)]
    jsonl, parquet = _write_rows(tmp_path, rows)
    for keys in ({}, {"label_key": "final"}):  # the default columns, then a mapped label column
        from_jsonl = FileSource(jsonl, seed=3, **keys)
        from_parquet = FileSource(parquet, seed=3, **keys)
        assert from_parquet.size == 5
        served = [(p.prompt, p.label) for p in from_parquet.next_prompts(5)]
        assert served == [(p.prompt, p.label) for p in from_jsonl.next_prompts(5)]
        assert sorted(label for _, label in served) == sorted(r[keys.get("label_key", "answer")] for r in rows)


def test_a_parquet_file_with_a_null_label_or_without_the_mapped_column_is_named_in_one_line(tmp_path):
    rows = [{"question": "1 + 1?", "answer": "2"}, {"question": "2 + 2?", "answer": None}]
    _, parquet = _write_rows(tmp_path, rows)
    with pytest.raises(ValueError, match=r"has 1 bad row .*: rows\.parquet:row 1: 'answer' is null\. Fix the rows"):
        FileSource(parquet, seed=0)
    skipped = FileSource(parquet, seed=0, bad_rows="skip")
    assert skipped.size == 1 and skipped.bad_row_reasons == ["rows.parquet:row 1: 'answer' is null"]
    with pytest.raises(ValueError, match="data.label_key is 'solution', but no row of rows.parquet has it"):
        FileSource(parquet, seed=0, label_key="solution")
