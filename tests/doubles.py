"""Cheap stand-ins for the model-bound loop components (a backend without a model, a publisher, a sink, token
prompts and their reward for the toy task), shared
by the loop tests. ``tests/`` is on ``sys.path`` (``pythonpath`` in pyproject.toml): ``from doubles import ...``."""

from __future__ import annotations

import json

import torch
from miles.core.sample import Sample


class FakeBackend:
    """``TrainBackend`` without a model: old log-probs are 0, every step records its batch and counts.

    Args:
        old_log_probs: whether ``forward`` can give ``old_log_probs`` (0 everywhere).
    """

    def __init__(self, *, old_log_probs: bool = True) -> None:
        self.available_outputs = frozenset({"old_log_probs"} if old_log_probs else ())
        self.batches = []  # one per forward_backward
        self.forwards = []  # requested outputs per forward
        self.steps = 0

    def forward(self, batch, *, outputs):
        self.forwards.append(set(outputs))
        return batch.replace(old_log_probs=torch.zeros(batch.loss_mask.shape))

    def forward_backward(self, batch, objective, counts):
        self.batches.append(batch)
        return {"loss": 0.0}

    def optimizer_step(self):
        self.steps += 1
        return {}

    def push_weights(self, version):
        pass

    def save(self, path):
        (path / "trainer_state.json").write_text(json.dumps({"step": self.steps}))

    def load(self, path):
        self.steps = json.loads((path / "trainer_state.json").read_text())["step"]


class CountingPublisher:
    """``WeightPublisher`` that counts versions (no engine)."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def publish(self) -> int:
        self.version += 1
        return self.version


class NullSink:
    def log(self, metrics, step):
        pass

    def close(self):
        pass


class ListSink:
    """Keeps every logged row, ``{"step": step, **metrics}``."""

    def __init__(self) -> None:
        self.rows = []

    def log(self, metrics, step):
        self.rows.append({"step": step, **metrics})

    def close(self):
        pass


TARGETS = set(range(20, 28))  # 8 of 32 tokens: a random policy starts near 25% reward


class TokenPrompts:
    """Prompts [1, k] as token ids (no tokenizer needed)."""

    def __init__(self):
        self.count = 0

    def next_prompts(self, num):
        prompts = [
            Sample(index=i, group_index=self.count + i, prompt=[1, 3 + (self.count + i) % 8]) for i in range(num)
        ]
        self.count += num
        return prompts

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def first_token_reward(sample: Sample) -> float:
    return 1.0 if sample.response_tokens[0] in TARGETS else 0.0


def hold_sampling_step(engine, step, until, *, num_prompts=1):
    """Hold the embedded engine's model while it computes the logits of response token ``step`` (1 = the first),
    until ``until()`` (at most 30 s); returns (an Event set once held, the hook handle).

    The hook counts LM-head calls: with continuous batching one per distinct prompt prefilled (``num_prompts``,
    together giving token 1) and one per decode step; through HF ``generate`` one per forward (a batched prefill,
    then decode steps). So once held, every row has sampled ``step - 1`` tokens and will sample one more.
    """
    import threading
    import time

    call = (num_prompts + step - 1) if engine.continuous else step
    held, calls = threading.Event(), []

    def hook(module, args):
        calls.append(1)
        if len(calls) == call:
            held.set()
            deadline = time.monotonic() + 30
            while not until() and time.monotonic() < deadline:
                threading.Event().wait(0.01)

    return held, engine.model.lm_head.register_forward_pre_hook(hook)
