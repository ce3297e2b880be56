"""``reward.path`` (one sample -> float) and ``reward.group_path`` (one group -> its rewards)."""


def answer_in_response(sample):
    """1.0 when the hook's parsed answer (``sample_hook.tag_answer``), else the last integer of the response,
    equals the label, else 0.0."""
    answer = sample.metadata.get("parsed_answer")
    return float(answer is not None and str(answer) == str(sample.label).strip())


def rank_in_group(group):
    """Rank-based rewards within the group: the i-th smallest reward becomes i / (n - 1) in [0, 1], ties sharing
    their mean rank, so the group's spread no longer depends on the reward's scale (a group of one gets 0.5)."""
    rewards = [s.reward for s in group]
    if len(rewards) == 1:
        return [0.5]
    order = sorted(range(len(rewards)), key=lambda i: rewards[i])
    ranks = [0.0] * len(rewards)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and rewards[order[j + 1]] == rewards[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 / (len(rewards) - 1)
        i = j + 1
    return ranks
