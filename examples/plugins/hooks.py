"""``run.hooks``: a train-hook factory. Appends one JSON line per event to ``<run dir>/hooks.jsonl``."""

import json


class RecordingHooks:
    def __init__(self, path):
        self.path = path

    def _write(self, **event):
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")

    def on_rollout_end(self, step, samples):
        self._write(
            event="rollout_end",
            step=step,
            rewards=[s.reward for s in samples],
            group_index=[s.group_index for s in samples],
            metadata_keys=sorted({key for s in samples for key in s.metadata}),
            first_prompt=samples[0].prompt[-1]["content"] if isinstance(samples[0].prompt, list) else None,
        )

    def on_train_step_end(self, step, metrics):
        self._write(event="train_step_end", step=step, loss=metrics.get("loss"))

    def on_save(self, step, path):
        self._write(event="save", step=step, path=str(path))


def build_hooks(context):
    """(context: RunContext) -> TrainHooks."""
    return RecordingHooks(context.run_dir / "hooks.jsonl")
