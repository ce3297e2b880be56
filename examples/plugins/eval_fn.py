"""``eval.path``: an eval function. The built-in evaluation plus the longest response and an exact-answer rate."""

from miles.core.buffer import generate_samples
from miles.core.evaluation import evaluate


def evaluate_with_length(components, evaluation):
    """(components, evaluation) -> metrics: ``miles.core.evaluation.evaluate``'s, plus ``eval/max_response_length``
    (tokens) and ``eval/answered`` (fraction of samples whose response holds a number)."""
    metrics = evaluate(components, evaluation)
    prompts = list(components.eval_prompts)[: evaluation.num_prompts]
    samples = generate_samples(
        prompts[:1], components.generate_group, n_samples_per_prompt=1, sampling=evaluation.sampling, seed=0
    )  # a second, small generation: what an eval function may do with the engine
    metrics["eval/max_response_length"] = float(max(s.response_length for s in samples))
    metrics["eval/answered"] = sum(any(c.isdigit() for c in s.response_text or "") for s in samples) / len(samples)
    return metrics
