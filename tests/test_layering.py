"""Lower layers never import higher ones (DESIGN.md section 1); miles.sync imports torch and nothing else of Miles."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "packages"
ALLOWED = {
    "sync": set(),
    "core": {"sync"},
    "rollout": {"core", "sync"},
    "train": {"core", "sync"},
    "recipes": {"core", "rollout", "train", "sync", "diffusion"},
    "diffusion": {"core", "train", "sync"},
}


def _miles_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found |= {n.split(".")[1] for n in names if n.startswith("miles.") and len(n.split(".")) > 1}
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_lower_layers(package):
    sources = list((ROOT / f"miles-{package}" / "src" / "miles" / package).rglob("*.py"))
    assert sources
    for path in sources:
        bad = _miles_imports(path) - ALLOWED[package] - {package}
        assert not bad, f"{path.relative_to(ROOT)} imports higher layer(s) {sorted(bad)}"


def test_miles_is_a_namespace_package_in_every_distribution():
    assert not list(ROOT.glob("*/src/miles/__init__.py"))


# Names of RL formulas and their settings; a training backend runs forward/backward of a given objective only.
RL_NAMES = {
    "advantages",
    "aggregate",
    "clip_high",
    "clip_low",
    "entropy_coef",
    "importance_weights",
    "kl_coef",
    "kl_estimate",
    "kl_estimator",
    "off_policy_sequence_mask",
    "policy_loss",
    "ppo_clip",
    "returns",
    "value_clip",
    "value_loss",
}


def test_no_rl_formula_in_the_training_backends():
    """miles.train imports no RL module (only the objective seam) and names no RL quantity in its code."""
    sources = list((ROOT / "miles-train" / "src" / "miles" / "train").rglob("*.py"))
    assert sources
    for path in sources:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("miles.core.algorithms"):
                assert node.module == "miles.core.algorithms.objective", f"{path.name} imports {node.module}"
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if isinstance(node, (ast.FunctionDef, ast.arg)):
                name = node.name if isinstance(node, ast.FunctionDef) else node.arg
            assert name not in RL_NAMES, f"{path.relative_to(ROOT)}:{node.lineno} uses {name!r}, an RL formula's name"
