"""The bundled visual problems: every answer is right when checked against the pixels (circles counted by flood
fill, the square's colour read back, the red shape's centroid located), problems are a pure function of (seed,
index), the prompt has the multimodal chat layout with the PNG beside it, and the source resumes and refuses bad
options."""

import base64
import json

import pytest
from miles.core.protocols import DataContext
from miles.rollout.config import DataConfig
from miles.rollout.data.visual_tasks import (
    BACKGROUND,
    FAMILY_NAMES,
    PALETTE,
    VisualTaskSource,
    build_source,
    decode_images,
    make_problem,
)


def _image_of(source, index):
    sample = source.sample_at(index, index)
    (image,) = decode_images(sample)
    return image, sample.label


def _foreground(image):
    """{(x, y): rgb} of every pixel that is not background."""
    width, height = image.size
    pixels = image.load()
    return {(x, y): pixels[x, y] for x in range(width) for y in range(height) if pixels[x, y] != BACKGROUND}


def _num_components(points):
    """Connected components (4-neighbour flood fill) of a set of pixel coordinates."""
    unseen, num = set(points), 0
    while unseen:
        num += 1
        stack = [unseen.pop()]
        while stack:
            x, y = stack.pop()
            for neighbour in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if neighbour in unseen:
                    unseen.remove(neighbour)
                    stack.append(neighbour)
    return num


def _context(split="train", **task_kwargs):
    data = DataConfig(
        source="custom", source_path="miles.rollout.data.visual_tasks:build_source", size=6, task_kwargs=task_kwargs
    )
    return DataContext(data=data, split=split, seed=data.seed if split == "train" else data.eval_seed)


def test_a_problem_is_a_pure_function_of_seed_and_index():
    first, again = VisualTaskSource(size=10, seed=3), VisualTaskSource(size=10, seed=3)
    for index in range(6):
        a, b = first.sample_at(index, 0), again.sample_at(index, 7)
        assert a.metadata["images"] == b.metadata["images"] and a.label == b.label and a.prompt == b.prompt
    images = [first.sample_at(index, 0).metadata["images"][0] for index in range(6)]
    assert len(set(images)) == 6  # every index draws a different picture
    assert (
        VisualTaskSource(size=10, seed=4).sample_at(0, 0).metadata["images"] != first.sample_at(0, 0).metadata["images"]
    )
    assert [first.sample_at(i, 0).metadata["family"] for i in range(3)] == list(FAMILY_NAMES)


@pytest.mark.parametrize("image_size", [32, 64])
def test_the_count_answer_is_the_number_of_separate_one_colour_circles(image_size):
    source = VisualTaskSource(size=20, seed=5, families=["count"], image_size=image_size)
    answers = set()
    for index in range(20):
        image, label = _image_of(source, index)
        foreground = _foreground(image)
        assert len(set(foreground.values())) == 1 and set(foreground.values()) <= set(PALETTE.values())
        assert _num_components(foreground) == int(label), index
        answers.add(label)
    assert answers == {"1", "2", "3", "4", "5"}


def test_the_colour_answer_is_the_colour_of_the_squares_pixels():
    source = VisualTaskSource(size=12, seed=5, families=["colour"])
    answers = set()
    for index in range(12):
        image, label = _image_of(source, index)
        foreground = _foreground(image)
        assert set(foreground.values()) == {PALETTE[label]}
        xs, ys = [x for x, _ in foreground], [y for _, y in foreground]
        side = max(xs) - min(xs) + 1
        assert max(ys) - min(ys) + 1 == side and len(foreground) == side * side  # a filled square
        answers.add(label)
    assert answers == set(PALETTE)


def test_the_position_answer_is_the_half_holding_the_red_shape():
    source = VisualTaskSource(size=16, seed=5, families=["position"], image_size=64)
    answers = set()
    for index in range(16):
        image, label = _image_of(source, index)
        red_xs = [x for (x, _), rgb in _foreground(image).items() if rgb == PALETTE["red"]]
        assert red_xs and (sum(red_xs) / len(red_xs) < 32) == (label == "left")
        assert (max(red_xs) < 32) if label == "left" else (min(red_xs) >= 32)  # wholly on its half
        answers.add(label)
    assert answers == {"left", "right"}


def test_the_prompt_is_an_image_part_then_the_question_and_the_png_travels_in_metadata():
    source = VisualTaskSource(size=4, seed=2, image_size=48, system_prompt="Look closely.", prompt_suffix=" Be brief.")
    sample = source.sample_at(1, 9)
    family, drawn, answer = make_problem(1, seed=2, image_size=48)
    assert sample.prompt == [
        {"role": "system", "content": "Look closely."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": family.question + " Be brief."}]},
    ]
    assert sample.label == answer == answer.lower() and sample.group_index == 9
    assert sample.metadata["family"] == family.name and sample.metadata["data_index"] == 1
    (image,) = decode_images(sample.metadata)
    assert image.size == (48, 48) and image.mode == "RGB" and image.tobytes() == drawn.tobytes()
    assert decode_images(sample)[0].tobytes() == drawn.tobytes()
    png = sample.metadata["images"][0]
    assert isinstance(png, str) and base64.b64decode(png)[:4] == b"\x89PNG"
    # JSON-able: checkpoints of queued prompts and remote rewards serialize metadata as JSON
    assert decode_images(json.loads(json.dumps(sample.metadata)))[0].tobytes() == drawn.tobytes()


@pytest.mark.parametrize(
    "task_kwargs, message",
    [
        pytest.param(
            {"families": ["count", "shape"]}, r"data.task_kwargs.families is \['count', 'shape'\]", id="unknown"
        ),
        pytest.param({"families": []}, r"data.task_kwargs.families is \[\]", id="empty"),
        pytest.param({"families": "count"}, r"data.task_kwargs.families is 'count'", id="not_a_list"),
        pytest.param({"image_size": 16}, r"data.task_kwargs.image_size is 16; it must be an integer >= 32", id="small"),
        pytest.param(
            {"num_tests": 2}, r"data.task_kwargs \['num_tests'\] are not options of the visual tasks", id="key"
        ),
    ],
)
def test_bad_task_kwargs_raise_naming_the_key(task_kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        build_source(_context(**task_kwargs))
    if "families" in task_kwargs:
        assert "['count', 'colour', 'position']" in str(error.value)  # the valid names


def test_the_source_resumes_and_the_splits_differ():
    first = VisualTaskSource(size=4, seed=1)
    first.next_prompts(6)  # into the second epoch
    state = json.loads(json.dumps(first.state_dict()))
    again = VisualTaskSource(size=4, seed=1)
    again.load_state_dict(state)
    resumed, continued = again.next_prompts(3), first.next_prompts(3)
    assert [p.metadata["images"] for p in resumed] == [p.metadata["images"] for p in continued]
    assert [p.label for p in resumed] == [p.label for p in continued]
    train, held_out = build_source(_context(image_size=40)), build_source(_context("eval", image_size=40))
    assert train.image_size == 40 and train.seed != held_out.seed
    assert train.sample_at(0, 0).metadata["images"] != held_out.sample_at(0, 0).metadata["images"]
