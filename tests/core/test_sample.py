"""Sample is plain data: it pickles with every field, partial-rollout weight versions included."""

import pickle

from miles.core.sample import Sample, SampleStatus


def test_a_sample_pickles_with_its_weight_versions_status_and_metadata():
    sample = Sample(
        index=3,
        group_index=1,
        prompt=[{"role": "user", "content": "1+1?"}],
        label={"answer": "2"},
        tokens=[1, 5, 6, 2],
        response_length=2,
        loss_mask=[1, 1],
        rollout_log_probs=[-0.5, -0.25],
        reward=1.0,
        status=SampleStatus.ABORTED,
        weight_version=4,
        weight_versions=[3, 4],  # a partial rollout retracted at v3 and continued at v4
        response_text="2",
        metadata={"finish_reason": "abort"},
    )
    restored = pickle.loads(pickle.dumps(sample))
    assert restored == sample and restored.status is SampleStatus.ABORTED
    assert restored.weight_versions == [3, 4] and restored.response_tokens == [6, 2]
