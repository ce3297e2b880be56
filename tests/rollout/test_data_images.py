"""Data files with images (``data.image_key``): paths, base64 or bytes per row, several per prompt, placed at the
question's ``<image>`` markers; bad image columns named by file and line; the rows render through the VLM's
processor."""

import base64
import io
import json

import pytest
from miles.rollout.data.files import FileSource, image_messages
from miles.rollout.multimodal import load_image
from PIL import Image


def png(colour) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_images_go_at_the_markers_or_before_the_text():
    messages = image_messages("<image>left or <image>right?", 2, system_prompt="Be brief.", prompt_suffix=" One word.")
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "left or "}, {"type": "image"},
            {"type": "text", "text": "right? One word."},
        ]},
    ]  # fmt: skip
    # markers that do not match the images: all images first, the text (markers and all) after
    assert image_messages("What is <image>?", 2, system_prompt=None, prompt_suffix="")[0]["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "What is <image>?"},
    ]


def test_a_jsonl_file_with_image_paths_and_base64_gives_samples_with_their_images(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(png((255, 0, 0)))
    blue = base64.b64encode(png((0, 0, 255)) + b"\0" * 300).decode()  # > 255 characters: no file name
    rows = [
        {"question": "<image> vs <image>: which is red?", "answer": "first", "images": ["img/red.png", blue]},
        {"question": "Colour?", "answer": "red", "images": "img/red.png"},
        {"question": "No picture here.", "answer": "ok", "images": []},
    ]
    source = FileSource(write_jsonl(tmp_path / "rows.jsonl", rows), image_key="images")
    by_answer = {s.label: s for s in (source.sample_at(i, i) for i in range(3))}
    two = by_answer["first"]
    assert two.prompt[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": " vs "},
        {"type": "image"},
        {"type": "text", "text": ": which is red?"},
    ]
    assert two.metadata["images"] == [str((tmp_path / "img" / "red.png").resolve()), blue]
    assert [load_image(e).getpixel((0, 0)) for e in two.metadata["images"]] == [(255, 0, 0), (0, 0, 255)]
    assert by_answer["red"].prompt[0]["content"][0] == {"type": "image"}
    assert by_answer["ok"].prompt == [{"role": "user", "content": "No picture here."}]  # a text-only row
    assert "images" not in by_answer["ok"].metadata
    json.dumps(two.metadata)  # JSON-able: queued prompts are checkpointed as JSON


def test_a_parquet_file_with_datasets_image_records_keeps_their_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    green = png((0, 200, 0))
    rows = [{"question": "Colour?", "answer": "green", "image": {"bytes": green, "path": "g.png"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    sample = FileSource(tmp_path / "rows.parquet", image_key="image").sample_at(0, 0)
    assert sample.metadata["images"] == [base64.b64encode(green).decode()]
    assert sample.prompt[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Colour?"}]


def test_bad_image_columns_are_named_by_file_and_line(tmp_path):
    rows = [
        {"question": "a", "answer": "1", "images": ["x.png"]},
        {"question": "b", "answer": "2"},
        {"question": "c", "answer": "3", "images": [7]},
        {"question": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "d"}]}], "answer": "4",
         "images": []},
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError) as err:
        FileSource(path, image_key="images")
    message = str(err.value)
    assert "has 3 bad rows" in message
    assert "rows.jsonl:2: missing key 'images' (data.image_key)" in message
    assert "rows.jsonl:3: 'images': holds 7; expected image paths, base64 text, bytes" in message
    assert "rows.jsonl:4: 'question' has 1 image parts but 'images' has 0" in message
    with pytest.raises(ValueError, match="data.image_key is 'pics', but no row of rows.jsonl has it"):
        FileSource(path, image_key="pics")


def test_a_file_row_with_images_renders_through_the_vlm_processor(tiny_vlm_dir, tmp_path):
    from miles.rollout.multimodal import load_tokenizer

    (tmp_path / "a.png").write_bytes(png((255, 0, 0)))
    (tmp_path / "b.png").write_bytes(png((0, 0, 255)))
    rows = [{"question": "<image> or <image>?", "answer": "a", "images": ["a.png", "b.png"]}]
    sample = FileSource(write_jsonl(tmp_path / "rows.jsonl", rows), image_key="images").sample_at(0, 0)
    processor = load_tokenizer(tiny_vlm_dir)
    tokens, inputs = processor.render_sample(sample)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert tokens.count(processor.convert_tokens_to_ids("<|image_pad|>")) == 8
    assert "<|vision_end|> or <|vision_start|>" in processor.decode(tokens)
