"""A reward for tests/recipes/test_multiturn_e2e.py: the calculator recipe's reward, writing every sample it scores
(ids, masks, log-probs, turns) as a JSON line to the file $MILES_TEST_SAMPLES, so the test checks each one."""

import json
import os

from miles.rollout.rewards.final_answer import final_answer_reward


def recording_reward(sample):
    reward = final_answer_reward(sample)
    record = {
        "prompt": sample.prompt,
        "tokens": sample.tokens,
        "response_length": sample.response_length,
        "loss_mask": sample.loss_mask,
        "rollout_log_probs": sample.rollout_log_probs,
        "status": str(sample.status),
        "response_text": sample.response_text,
        "reward": reward,
        **{key: sample.metadata[key] for key in ("messages", "num_turns", "num_tool_calls", "stop_reason")},
    }
    with open(os.environ["MILES_TEST_SAMPLES"], "a") as f:
        f.write(json.dumps(record) + "\n")
    return reward
