"""Weight versions (``miles.sync.versions``): a push's version must be newer than the last committed one, and pruning
keeps the newest ``keep`` version directories."""

import logging

import pytest
from miles.sync.versions import find_versions, next_version, prune_versions, version_dir


def _make_versions(root, versions, *, marker=None):
    for version in versions:
        version_dir(root, version).mkdir(parents=True)
        if marker:
            (version_dir(root, version) / marker).write_text("{}")


def test_next_version_is_one_past_the_current_when_none_is_asked_for():
    assert next_version(None, 0, holder="this sink") == 1
    assert next_version(None, 7, holder="this sink") == 8


def test_next_version_accepts_any_newer_version():
    assert next_version(12, 7, holder="this sink") == 12


@pytest.mark.parametrize(
    "version, current, holder, message",
    [
        pytest.param(3, 3, "the engine", "push version 3 is not newer than the engine's v3", id="equal"),
        pytest.param(2, 5, "this sink", "push version 2 is not newer than this sink's v5", id="older"),
        pytest.param(0, 0, "this sender", "push version 0 is not newer than this sender's v0", id="zero_before_any"),
    ],
)
def test_next_version_refuses_a_version_that_is_not_newer(version, current, holder, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        next_version(version, current, holder=holder)


def test_prune_keeps_the_newest_keep_version_directories(tmp_path):
    _make_versions(tmp_path, [1, 2, 3, 4, 5])
    (tmp_path / ".v000006.partial").mkdir()  # a version being written is no version
    (tmp_path / "notes").mkdir()
    assert prune_versions(tmp_path, keep=2) == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".v000006.partial", "notes", "v000004", "v000005"]


def test_prune_with_fewer_versions_than_keep_deletes_nothing(tmp_path):
    _make_versions(tmp_path, [4, 5])
    assert prune_versions(tmp_path, keep=3) == []
    assert find_versions(tmp_path) == [4, 5]


def test_prune_counts_from_current_and_deletes_newer_versions_an_earlier_run_left(tmp_path, caplog):
    _make_versions(tmp_path, [1, 2, 3, 8, 9])  # a resumed run went back to v3; v8, v9 are the earlier run's
    with caplog.at_level(logging.WARNING, logger="miles.sync.versions"):
        assert prune_versions(tmp_path, keep=2, current=3) == [1, 8, 9]
    assert find_versions(tmp_path) == [2, 3]
    assert "removing versions [8, 9]" in caplog.text


def test_prune_with_a_marker_leaves_directories_without_it(tmp_path):
    _make_versions(tmp_path, [1, 2, 3], marker="manifest.json")
    _make_versions(tmp_path, [4])  # no manifest: not a published version, neither counted nor deleted
    assert find_versions(tmp_path, marker="manifest.json") == [1, 2, 3]
    assert prune_versions(tmp_path, keep=1, current=3, marker="manifest.json") == [1, 2]
    assert find_versions(tmp_path) == [3, 4]


def test_prune_of_a_missing_root_deletes_nothing(tmp_path):
    assert prune_versions(tmp_path / "absent", keep=2) == []


def test_prune_refuses_keep_below_one(tmp_path):
    _make_versions(tmp_path, [1])
    with pytest.raises(ValueError, match="keep is 0"):
        prune_versions(tmp_path, keep=0)
    assert find_versions(tmp_path) == [1]
