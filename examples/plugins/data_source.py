"""``data.source_path``: a data-source factory. Prompts "What is a + b?" with the sum as label, a pure function of
(seed, index), so the state is one counter and a resume continues at exactly the next prompt."""

import random

from miles.core.sample import Sample


class AdditionSource:
    """A ``DataSource``: ``next_prompts``, ``state_dict``, ``load_state_dict``."""

    def __init__(self, seed, *, max_operand=20):
        self.seed, self.max_operand, self.num_prompts = seed, max_operand, 0

    def next_prompts(self, num):
        prompts = []
        for _ in range(num):
            rng = random.Random(self.seed * 1_000_003 + self.num_prompts)
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            prompts.append(
                Sample(
                    index=self.num_prompts,
                    group_index=self.num_prompts,
                    prompt=[{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}],
                    label=str(a + b),
                )
            )
            self.num_prompts += 1
        return prompts

    def state_dict(self):
        return {"seed": self.seed, "num_prompts": self.num_prompts}

    def load_state_dict(self, state):
        if state["seed"] != self.seed:
            raise ValueError(f"data source state has seed {state['seed']}, this source {self.seed}")
        self.num_prompts = state["num_prompts"]


def build_source(context):
    """(context: DataContext) -> DataSource; ``data.task_kwargs.max_operand`` sets the operand range."""
    return AdditionSource(context.seed, max_operand=int(context.data.task_kwargs.get("max_operand", 20)))
