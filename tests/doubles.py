"""Cheap stand-ins for the model-bound loop components (a backend without a model, a publisher, a sink), shared
by the loop tests. ``tests/`` is on ``sys.path`` (``pythonpath`` in pyproject.toml): ``from doubles import ...``."""

from __future__ import annotations

import json

import torch


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
