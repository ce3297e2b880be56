"""Source audit: no unpickling of outside files and no execution of text as code anywhere in Miles.

``torch.load`` must pass ``weights_only=True`` (tensors and plain containers only: a checkpoint from elsewhere
cannot run code when loaded); ``pickle.load(s)`` is banned outright; weights are read with safetensors.
``eval``/``exec``/``compile`` of strings are banned: model-written text may only run in a sandboxed subprocess with
time and memory limits (``miles.rollout.rewards.sandbox``; see docs/reliability.md).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("packages", "tests") for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)
THIS = Path(__file__).resolve()

RULES = [
    pytest.param(re.compile(r"\btorch\.load\((?![^)]*weights_only=True)"), id="torch_load_without_weights_only"),
    pytest.param(re.compile(r"\b(c?pickle|dill|cloudpickle|joblib)\.loads?\("), id="pickle_load"),
    pytest.param(re.compile(r"(?<![.\w])(eval|exec)\("), id="eval_or_exec"),
    pytest.param(re.compile(r"\bsubprocess\.[a-z_]+\([^)]*shell=True"), id="shell_true"),
]


# (rule id, file) pairs exempt from a rule, each with the reason.
EXEMPT = {
    # Round-trips an object the test itself pickled one line earlier, to prove Sample crosses processes (Ray).
    ("pickle_load", "tests/core/test_sample.py"),
    # The worker process loads the TrainBatch its own test saved for it (a dataclass, not a weights-only container).
    ("torch_load_without_weights_only", "tests/train/fsdp2_vlm_worker.py"),
    # The preamble the sandbox's child process runs: it execs the model's program there, after setting the rlimits
    # and the audit hook (the one place model-written text runs, and never in the trainer process).
    ("eval_or_exec", "packages/miles-rollout/src/miles/rollout/rewards/sandbox.py"),
}


def test_the_audit_sees_the_source_tree():
    names = {p.name for p in SOURCES}
    assert len(SOURCES) > 50 and {"checkpoint.py", "backend.py", "sender.py"} <= names


@pytest.mark.parametrize("pattern", RULES)
def test_no_source_file_breaks_the_rule(pattern, request):
    rule = request.node.callspec.id
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in SOURCES
        if path != THIS and (rule, str(path.relative_to(ROOT))) not in EXEMPT
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert hits == []


def test_the_rules_catch_what_they_are_for():
    unsafe = ["torch.load(path)", "torch.load(f, map_location='cpu')", "pickle.load(f)", "pickle.loads(b)",
              "eval(text)", "exec(code)", "subprocess.run(cmd, shell=True)"]  # fmt: skip
    safe = ["torch.load(path, weights_only=True)", "model.eval()", "self.ref_model.eval()"]
    rules = [p.values[0] for p in RULES]
    assert all(any(r.search(line) for r in rules) for line in unsafe)
    assert not any(r.search(line) for r in rules for line in safe)
