"""Bad input never takes a run down: malformed data rows (per-row errors naming file and line, skip or stop) and
engine outputs that are empty, misaligned, non-finite, all-stop-token or truncated."""

import json
import math

import pytest
from miles.core.buffer import generate_samples
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateOutput
from miles.core.sample import Sample, SampleStatus
from miles.rollout.data import FileSource
from miles.rollout.generate import ChatRollout

GOOD = json.dumps({"question": "1+1?", "answer": "2"}).encode()

BAD_LINES = [
    pytest.param(b'{"question": "1+1?"', "not JSON", id="truncated_json"),
    pytest.param(b"\x1c", "not JSON", id="control_character"),  # str.strip() would call this line blank
    pytest.param(b"\x0c\x0b", "not JSON", id="form_feed_vertical_tab"),  # bytes.strip() would too
    pytest.param("\u00a0".encode(), "not JSON", id="no_break_space"),
    pytest.param(b"\xff\xfe{}", "not UTF-8", id="non_utf8"),
    pytest.param(json.dumps({"answer": "2"}).encode(), "missing key 'question'", id="missing_prompt"),
    pytest.param(json.dumps({"question": "1+1?"}).encode(), "missing key 'answer'", id="missing_label"),
    pytest.param(json.dumps({"question": "  ", "answer": "2"}).encode(), "empty string", id="blank_prompt"),
    pytest.param(json.dumps({"question": [], "answer": "2"}).encode(), "empty list", id="no_messages"),
    pytest.param(json.dumps({"question": 7, "answer": "2"}).encode(), "is a int", id="prompt_is_a_number"),
    pytest.param(json.dumps({"question": [{"role": "user"}], "answer": "2"}).encode(), "expected messages",
                 id="message_without_content"),
    pytest.param(json.dumps({"question": "1+1?", "answer": None}).encode(), "'answer' is null", id="null_label"),
    pytest.param(json.dumps([1, 2]).encode(), "JSON list", id="row_is_a_list"),
]  # fmt: skip


@pytest.mark.parametrize("bad_line, reason", BAD_LINES)
def test_a_bad_row_stops_the_run_naming_file_line_and_reason(tmp_path, bad_line, reason):
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD + b"\n" + bad_line + b"\n" + GOOD + b"\n")
    with pytest.raises(ValueError, match=rf"has 1 bad row \(.*data.jsonl:2(:\d+)?: .*{reason}.*--data.bad-rows skip"):
        FileSource(path)


@pytest.mark.parametrize("bad_line, reason", BAD_LINES)
def test_a_bad_row_is_skipped_and_counted_with_bad_rows_skip(tmp_path, bad_line, reason):
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD + b"\n" + bad_line + b"\n\n" + GOOD + b"\n")  # a blank line is not a row
    source = FileSource(path, bad_rows="skip")
    assert (source.size, source.num_bad_rows) == (2, 1)
    assert source.bad_row_reasons[0].startswith("data.jsonl:2")
    assert [s.label for s in source.next_prompts(2)] == ["2", "2"]


def test_a_json_error_names_its_column_on_the_line_not_past_the_line_break(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD + b"\r\n" + b'{"question": "1+1?"\r\n')  # 19 characters: the comma is missing at 20
    source = FileSource(path, bad_rows="skip")
    assert source.bad_row_reasons == ["data.jsonl:2:20: not JSON (Expecting ',' delimiter at column 20)"]


def test_only_json_whitespace_makes_a_line_blank(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n \t\r\n" + GOOD + b"\r\n\r\n   \n" + GOOD)  # CRLF, spaces, tabs, no final newline
    source = FileSource(path)
    assert (source.size, source.num_bad_rows) == (2, 0)


def test_several_bad_rows_are_reported_in_one_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join([GOOD] + [b"\x1c"] * 7))
    with pytest.raises(ValueError) as err:
        FileSource(path)
    message = str(err.value)
    assert "\n" not in message and "has 7 bad rows" in message
    assert "data.jsonl:2:1: not JSON" in message and "data.jsonl:6:1" in message and "and 2 more" in message


def test_an_empty_file_names_the_key_and_the_fix(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n\n")
    with pytest.raises(ValueError, match=r"data.path '.*data.jsonl' has no usable row \(the file is empty or blank\); "
                       "point --data.path at a file with rows"):  # fmt: skip
        FileSource(path)


def test_held_out_rows_are_never_served_for_training(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    source = FileSource(path, num_heldout=3)
    heldout = source.heldout_source(seed=5)
    train_labels = {s.label for s in source.next_prompts(20)}  # two epochs
    eval_labels = {s.label for s in heldout.next_prompts(3)}
    assert (source.size, heldout.size) == (7, 3)
    assert train_labels.isdisjoint(eval_labels) and train_labels | eval_labels == {str(i) for i in range(10)}
    # the held-out choice does not move with the training seed
    assert {r["answer"] for r in FileSource(path, seed=9, num_heldout=3).heldout_rows} == eval_labels
    with pytest.raises(ValueError, match="too few to hold out 10.*--data.eval-path"):
        FileSource(path, num_heldout=10)


def test_a_file_without_a_usable_row_fails_even_when_skipping(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"nope\n")
    with pytest.raises(ValueError, match="no usable row"):
        FileSource(path, bad_rows="skip")


class ScriptedEngine:
    """Returns the given outputs in the order requests arrive (an engine misbehaving in a controlled way)."""

    weight_version = 3

    def __init__(self, outputs):
        self.outputs = iter(outputs)

    async def generate(self, request):
        return next(self.outputs)


def test_empty_misaligned_and_nonfinite_engine_outputs_fail_their_sample_only():
    outputs = [
        GenerateOutput([], [], "stop"),
        GenerateOutput([5, 6], [-1.0], "stop"),
        GenerateOutput([5, 6], [-1.0, math.nan], "stop"),
        GenerateOutput([5, 6], [-1.0, -math.inf], "length"),
        GenerateOutput([2], [-0.5], "stop"),  # only the stop token: a legitimate (empty-text) answer
        GenerateOutput([5, 6, 7], [-1.0, -1.0, -1.0], "length"),  # hit max_new_tokens
    ]
    prompts = [Sample(index=0, group_index=0, prompt=[1, 4])]
    samples = generate_samples(
        prompts, ChatRollout(ScriptedEngine(outputs), tokenizer=None), n_samples_per_prompt=6,
        sampling=SamplingConfig(max_new_tokens=3), seed=0,
    )  # fmt: skip
    assert [s.status for s in samples] == [SampleStatus.FAILED] * 4 + [SampleStatus.COMPLETED, SampleStatus.TRUNCATED]
    assert [s.metadata["failure"] for s in samples[:4]] == [
        "engine returned an empty response",
        "engine returned 1 log-probs for 2 tokens",
        "engine returned non-finite log-probs (NaN/inf logits)",
        "engine returned non-finite log-probs (NaN/inf logits)",
    ]
    for s in samples[:4]:  # the response is dropped: nothing non-finite or misaligned reaches a batch
        assert (s.tokens, s.response_length, s.rollout_log_probs) == ([1, 4], 0, [])


def test_a_prompt_longer_than_the_context_fails_its_samples_without_calling_the_engine():
    prompts = [Sample(index=0, group_index=0, prompt=list(range(1, 40)))]
    samples = generate_samples(
        prompts, ChatRollout(ScriptedEngine([]), tokenizer=None, max_prompt_tokens=16), n_samples_per_prompt=2,
        sampling=SamplingConfig(), seed=0,
    )  # fmt: skip
    assert [s.status for s in samples] == [SampleStatus.FAILED] * 2
    assert samples[0].metadata["failure"] == "prompt has 39 tokens > max_prompt_tokens"


def test_an_images_column_the_config_does_not_name_is_warned_about_once(tmp_path, caplog):
    # Regression (new-user trial): a VLM dataset without --data.image-key trained text-only without a word.
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"question": "How many dots?", "answer": "3", "images": ["a.png"]}) + "\n")
    with caplog.at_level("WARNING"):
        FileSource(path)
    warnings = [r.getMessage() for r in caplog.records if "data.image_key is empty" in r.getMessage()]
    assert len(warnings) == 1 and "--data.image-key images" in warnings[0]


def test_a_source_path_left_from_a_recipe_names_the_override_that_drops_it():
    from miles.rollout.config import DataConfig

    with pytest.raises(ValueError, match=r"data.source is 'file' but data.source_path is 'pkg.mod:build'.*"
                                         r"--data.source-path '' to drop it"):  # fmt: skip
        DataConfig(source="file", path="x.jsonl", source_path="pkg.mod:build")
