"""Image inputs beside token ids (``miles.core.multimodal``): checked once, carried per row through every batch
operation (select, slice, micro-batches, rank shards), concatenated in row order for the forward."""

import pytest
import torch
from miles.core.batch import build_train_batch, split_micro_batches
from miles.core.multimodal import concat_multimodal, num_image_tokens, validate_multimodal
from miles.core.sample import Sample


def inputs(num_patches: int, fill: float) -> dict:
    return {
        "pixel_values": torch.full((num_patches, 6), fill),
        "image_grid_thw": torch.tensor([[1, 2, num_patches // 2]]),
    }


def samples() -> list[Sample]:
    rows = [inputs(4, 0.0), None, inputs(8, 2.0)]  # row 1 is text-only
    return [
        Sample(index=i, group_index=0, prompt="p", tokens=[5] * (3 + i) + [7, 8], response_length=2,
               rollout_log_probs=[-1.0, -2.0], multimodal_inputs=m)
        for i, m in enumerate(rows)
    ]  # fmt: skip


def test_malformed_inputs_are_named_in_one_line():
    validate_multimodal(inputs(4, 1.0))
    with pytest.raises(ValueError, match=r"must hold exactly \['pixel_values', 'image_grid_thw'\]"):
        validate_multimodal({"pixel_values": torch.zeros(4, 6)})
    with pytest.raises(ValueError, match="pixel_values must be a \\[patches, dim\\] float tensor, got \\(4,\\)"):
        validate_multimodal({"pixel_values": torch.zeros(4), "image_grid_thw": torch.tensor([[1, 2, 2]])})
    with pytest.raises(ValueError, match="image_grid_thw must be an \\[images, 3\\] integer tensor"):
        validate_multimodal({"pixel_values": torch.zeros(4, 6), "image_grid_thw": torch.tensor([[1.0, 2.0, 2.0]])})
    broken = samples()
    broken[2].multimodal_inputs = {**inputs(8, 2.0), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    with pytest.raises(ValueError, match="sample 2: multimodal_inputs: image_grid_thw covers 4 patches but"):
        build_train_batch(broken, torch.zeros(3), pad_token_id=0)


def test_rows_concatenate_in_row_order_skipping_text_rows_and_count_merged_tokens():
    merged = concat_multimodal([inputs(4, 0.0), None, inputs(8, 2.0)])
    assert merged["pixel_values"][:, 0].tolist() == [0.0] * 4 + [2.0] * 8
    assert merged["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]
    assert concat_multimodal([None, None]) is None
    assert num_image_tokens(merged, merge_size=2) == [1, 2]  # 4 and 8 patches, 2 x 2 merged


def test_every_batch_operation_keeps_each_rows_images_with_its_tokens():
    batch = build_train_batch(samples(), torch.zeros(3), pad_token_id=0)
    assert [m is None for m in batch.multimodal_inputs] == [False, True, False]
    picked = batch.select(torch.tensor([2, 0, 0]))
    assert [m["pixel_values"].shape[0] for m in picked.multimodal_inputs] == [8, 4, 4]
    assert picked.prompt_lengths.tolist() == [5, 3, 3]
    sliced = batch.slice(1, 3)
    assert sliced.multimodal_inputs[0] is None and sliced.multimodal_inputs[1]["pixel_values"].shape[0] == 8
    micro = split_micro_batches(batch, 2)
    assert [len(mb.multimodal_inputs) for mb in micro] == [2, 1]
    text_only = build_train_batch(samples()[1:2], torch.zeros(1), pad_token_id=0)
    assert text_only.multimodal_inputs is None


def test_a_padded_rank_shard_keeps_a_tuple_per_row():
    from miles.train.ray_group import pad_shard

    batch = build_train_batch(samples(), torch.ones(3), pad_token_id=0)
    shard = pad_shard(batch, range(2, 3), num_rows=2)  # row 2, then a filler copy of the shortest row (0)
    assert shard.multimodal_inputs[0]["pixel_values"].shape[0] == 8
    assert shard.multimodal_inputs[1]["pixel_values"].shape[0] == 4
    assert shard.loss_mask[1].sum() == 0  # the filler trains nothing


def test_a_sample_whose_prompt_failed_before_generation_is_an_untrained_placeholder_row():
    """Regression: a prompt that fails to render (an unreadable image, too many tokens) leaves its samples without
    tokens; build_train_batch raised 'has no prompt tokens' and the whole step crashed whenever other prompts of the
    step succeeded. Now such an untrained sample is a one-pad-token row that trains nothing."""
    ok = samples()
    failed = Sample(index=3, group_index=1, prompt="p")  # FAILED in generate_group: no tokens, no log-probs
    batch = build_train_batch([*ok, failed], torch.ones(4), pad_token_id=0, trained=[True, True, True, False])
    assert batch.prompt_lengths.tolist() == [3, 4, 5, 1] and batch.response_lengths.tolist() == [2, 2, 2, 0]
    assert batch.attention_mask[3].tolist() == [True] + [False] * 6 and batch.tokens[3, 0] == 0
    assert not batch.loss_mask[3].any() and batch.advantages[3].abs().sum() == 0
    assert batch.rollout_log_probs is not None  # the failed row does not switch the mismatch metrics off
    assert batch.multimodal_inputs[3] is None
    with pytest.raises(ValueError, match="sample 3 has no prompt tokens"):  # a trained one still cannot
        build_train_batch([*ok, failed], torch.ones(4), pad_token_id=0)


def tiles(num_tiles: int, fill: float, side: int = 4) -> dict:
    """Idefics3-layout inputs of one sample: ``num_tiles`` tiles [N, 3, side, side], every pixel real."""
    return {
        "pixel_values": torch.full((num_tiles, 3, side, side), fill),
        "pixel_attention_mask": torch.ones(num_tiles, side, side, dtype=torch.bool),
    }


def test_idefics3_tiles_concatenate_along_the_tile_axis_in_row_order():
    merged = concat_multimodal([tiles(2, 1.0), None, tiles(3, 2.0)])
    assert merged["pixel_values"].shape == (1, 5, 3, 4, 4) and merged["pixel_attention_mask"].shape == (1, 5, 4, 4)
    assert merged["pixel_values"][0, :, 0, 0, 0].tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match=r"image tiles of different sizes \[\(3, 4, 4\), \(3, 8, 8\)\]"):
        concat_multimodal([tiles(2, 1.0), tiles(1, 1.0, side=8)])
    with pytest.raises(ValueError, match="mix Qwen-VL and Idefics3 image inputs"):
        concat_multimodal([tiles(2, 1.0), inputs(4, 1.0)])


def test_malformed_idefics3_inputs_are_named_in_one_line():
    validate_multimodal(tiles(2, 1.0))
    with pytest.raises(ValueError, match=r"pixel_values must be a \[tiles, channels, height, width\] float tensor"):
        validate_multimodal(
            {**tiles(2, 1.0), "pixel_values": torch.zeros(1, 2, 3, 4, 4)}
        )  # the processor's [1, N, ...]
    with pytest.raises(ValueError, match=r"pixel_attention_mask must be a \[tiles, height, width\] bool tensor"):
        validate_multimodal({**tiles(2, 1.0), "pixel_attention_mask": torch.ones(2, 4, 4, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"must hold exactly \['pixel_values', 'pixel_attention_mask'\]"):
        validate_multimodal({**tiles(2, 1.0), "image_grid_thw": torch.tensor([[1, 2, 2]])})


def test_an_idefics3_tile_is_image_seq_len_placeholders_and_an_all_zero_tile_none():
    """(image_size // patch_size)**2 // scale_factor**2 = (32 // 8)**2 // 2**2 = 4 per tile; the model drops a tile
    whose pixels are all exactly 0 (its padding), so it fills none."""
    from types import SimpleNamespace

    from miles.core.multimodal import idefics3_image_seq_len, num_placeholder_tokens

    config = SimpleNamespace(model_type="smolvlm", scale_factor=2,
                             vision_config=SimpleNamespace(image_size=32, patch_size=8))  # fmt: skip
    assert idefics3_image_seq_len(config) == 4
    padded = tiles(3, 1.0)
    padded["pixel_values"][2] = 0.0
    assert num_placeholder_tokens(config, padded) == 2 * 4
    qwen = SimpleNamespace(model_type="qwen3_vl", vision_config=SimpleNamespace(spatial_merge_size=2))
    with pytest.raises(ValueError, match="takes Qwen-VL-layout image inputs but a row carries"):
        num_placeholder_tokens(qwen, tiles(1, 1.0))
