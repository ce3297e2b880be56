"""SmolLM2-VL (``miles.recipes.models.smollm2_vl``): SmolLM2-135M-Instruct's language model inside a Qwen2-VL, so a
vision-language policy that answers in words can be trained on a CPU."""

import torch
from miles.core.multimodal import load_policy_model
from miles.rollout.data.visual_tasks import VisualTaskSource
from miles.rollout.multimodal import load_tokenizer


def test_on_text_its_logits_are_smollm2s_and_images_become_four_tokens(smollm2_vl_dir, smollm2_dir):
    vlm = load_policy_model(smollm2_vl_dir, dtype=torch.float32).eval()
    text = load_policy_model(smollm2_dir, dtype=torch.float32).eval()
    assert vlm.config.model_type == "qwen2_vl" and type(text).__name__ == "LlamaForCausalLM"
    processor = load_tokenizer(smollm2_vl_dir)
    from miles.rollout.generate import render_prompt

    ids = torch.tensor([render_prompt(processor, [{"role": "user", "content": "What is 2 + 3?"}])])
    with torch.no_grad():
        gap = (vlm(input_ids=ids).logits[..., : text.config.vocab_size] - text(input_ids=ids).logits).abs().max()
    # Qwen2 with zero q/k/v biases is Llama; multimodal RoPE on text (equal position components) is RoPE
    assert float(gap) < 1e-4, gap
    visual = sum(p.numel() for n, p in vlm.named_parameters() if n.startswith("model.visual."))
    assert 300_000 < visual < 500_000  # 379,200: a small random tower under a 134.5 M language model
    tokens, inputs = processor.render_sample(VisualTaskSource(size=4, seed=0, families=["colour"]).sample_at(0, 0))
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert tokens.count(processor.convert_tokens_to_ids("<|image_pad|>")) == 4
    with torch.no_grad():  # the image reaches the logits
        kwargs = dict(input_ids=torch.tensor([tokens]), image_grid_thw=inputs["image_grid_thw"],
                      mm_token_type_ids=(torch.tensor([tokens]) == vlm.config.image_token_id).int())  # fmt: skip
        own = vlm(pixel_values=inputs["pixel_values"], **kwargs).logits[0, -1]
        blank = vlm(pixel_values=torch.zeros_like(inputs["pixel_values"]), **kwargs).logits[0, -1]
    assert float((own - blank).abs().max()) > 1e-3
