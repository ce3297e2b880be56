"""``algorithm.dynamic_sampling.filter_path`` (keep or drop a group, with a reason) and
``algorithm.buffer_filter_path`` (which scored groups a step trains on)."""

from miles.core.sample import SampleStatus


def has_two_rewards(group):
    """Keep a group whose scored samples have at least two different rewards; else drop it, saying why."""
    rewards = {s.reward for s in group if s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)}
    if not rewards:
        return False, "all_failed"
    return (True, "") if len(rewards) > 1 else (False, "same_reward")


def drop_failed_groups(groups):
    """Train on the groups with no FAILED sample; if every group has one, keep them all (a step needs a group)."""
    clean = [g for g in groups if not any(s.status == SampleStatus.FAILED for s in g)]
    return clean or groups
