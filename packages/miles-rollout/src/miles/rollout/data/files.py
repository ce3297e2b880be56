"""Prompts from local JSONL or Parquet files, validated row by row so a bad row names its file and line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from miles.core.sample import Sample
from miles.rollout.data.epoch import EpochShuffledSource, make_messages

logger = logging.getLogger(__name__)

_SUFFIXES = (".jsonl", ".json", ".parquet")
# Bad rows listed in full in an error / warning; the rest are counted.
_NUM_LISTED = 5


def row_problem(row: Any, *, prompt_key: str, label_key: str) -> str | None:
    """Why a row cannot become a prompt, or None if it can.

    A usable row is a mapping whose ``prompt_key`` is a non-blank string or a non-empty list of chat messages
    (``{"role": str, "content": str}``) and whose ``label_key`` is present and not null.
    """
    if not isinstance(row, dict):
        return f"row is a JSON {type(row).__name__}, expected an object with keys {prompt_key!r}, {label_key!r}"
    if prompt_key not in row:
        return f"missing key {prompt_key!r} (data.prompt_key); row has keys {sorted(row)[:8]}"
    if label_key not in row:
        return f"missing key {label_key!r} (data.label_key); row has keys {sorted(row)[:8]}"
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            return f"{prompt_key!r} is an empty string"
    elif isinstance(prompt, list):
        if not prompt:
            return f"{prompt_key!r} is an empty list of messages"
        for message in prompt:
            ok = isinstance(message, dict) and isinstance(message.get("role"), str)
            if not ok or not isinstance(message.get("content"), str):
                return f"{prompt_key!r} holds {message!r}, expected messages {{'role': str, 'content': str}}"
    else:
        return f"{prompt_key!r} is a {type(prompt).__name__} ({prompt!r:.40}), expected a string or chat messages"
    if row[label_key] is None:
        return f"{label_key!r} is null"
    return None


def read_jsonl_rows(path: Path, *, prompt_key: str, label_key: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Good rows of a JSONL file and one ``file:line: reason`` string per bad line (blank lines are skipped).

    Each line is decoded as UTF-8 and parsed on its own, so one broken line never hides the others.
    """
    rows, problems = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path.name}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                problems.append(f"{where}: not UTF-8 ({err.reason} at byte {err.start})")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                problems.append(f"{where}: not JSON ({err.msg} at column {err.colno})")
                continue
            problem = row_problem(row, prompt_key=prompt_key, label_key=label_key)
            if problem is None:
                rows.append(row)
            else:
                problems.append(f"{where}: {problem}")
    return rows, problems


def read_parquet_rows(path: Path, *, prompt_key: str, label_key: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Good rows of a Parquet file (through HF ``datasets``) and one ``file:row N: reason`` per bad row."""
    import datasets

    table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    rows, problems = [], []
    for number, row in enumerate(table):
        problem = row_problem(row, prompt_key=prompt_key, label_key=label_key)
        if problem is None:
            rows.append(row)
        else:
            problems.append(f"{path.name}:row {number}: {problem}")
    return rows, problems


class FileSource(EpochShuffledSource):
    """``DataSource`` over a local JSONL/Parquet file; rows are reshuffled every epoch with a seeded order.

    Every row is validated at construction (see ``row_problem``). Bad rows either stop the run with a list of
    ``file:line: reason`` (``bad_rows="stop"``) or are left out and counted in ``num_bad_rows`` (``"skip"``).

    Args:
        path: the file (``.jsonl``, ``.json`` (JSON lines) or ``.parquet``).
        prompt_key: column with the question text (or a list of chat messages).
        label_key: column with the reference answer (e.g. GSM8K's "answer" ending in ``#### 42``).
        seed: shuffle seed; system_prompt, prompt_suffix: as in ``make_messages``.
        limit: use only the first ``limit`` good rows (0 = all).
        bad_rows: "stop" or "skip", see above.
    Raises: FileNotFoundError; ValueError naming the file and each bad row (stop), or when no row is usable.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        prompt_key: str = "question",
        label_key: str = "answer",
        seed: int = 0,
        system_prompt: str | None = None,
        prompt_suffix: str = "",
        limit: int = 0,
        bad_rows: Literal["skip", "stop"] = "stop",
    ) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"data.path {str(path)!r} does not exist; point --data.path at a JSONL/Parquet file"
            )
        if path.suffix not in _SUFFIXES:
            raise ValueError(f"data.path {str(path)!r}: unsupported suffix {path.suffix!r}; use .jsonl or .parquet")
        read = read_parquet_rows if path.suffix == ".parquet" else read_jsonl_rows
        rows, problems = read(path, prompt_key=prompt_key, label_key=label_key)
        listed = "\n  ".join(problems[:_NUM_LISTED]) + (
            f"\n  ... and {len(problems) - _NUM_LISTED} more" if len(problems) > _NUM_LISTED else ""
        )
        for key, field in ((prompt_key, "prompt_key"), (label_key, "label_key")):
            if not rows and problems and all(f"missing key {key!r}" in problem for problem in problems):
                flag = "--data." + field.replace("_", "-")
                raise ValueError(
                    f"data.{field} is {key!r}, but no row of {path.name} has it ({problems[0]}); set {flag}"
                )
        if problems and bad_rows == "stop":
            raise ValueError(
                f"data.path {str(path)!r}: {len(problems)} bad rows (data.bad_rows is 'stop'):\n  {listed}\n"
                "Fix the rows, check --data.prompt-key / --data.label-key, or pass --data.bad-rows skip to leave "
                "them out."
            )
        if not rows:
            raise ValueError(f"data.path {str(path)!r} has no usable row ({len(problems)} bad):\n  {listed}")
        if problems:
            logger.warning("%s: skipped %d of %d rows (data.bad_rows=skip):\n  %s", path, len(problems),
                           len(problems) + len(rows), listed)  # fmt: skip
        self.rows = rows[:limit] if limit else rows
        self.num_bad_rows, self.bad_row_reasons = len(problems), problems
        self.path, self.prompt_key, self.label_key, self.seed = path, prompt_key, label_key, seed
        self.system_prompt, self.prompt_suffix = system_prompt, prompt_suffix
        self._start()

    @property
    def size(self) -> int:
        return len(self.rows)

    def sample_at(self, index: int, group_index: int) -> Sample:
        row = self.rows[index]
        prompt = row[self.prompt_key]
        if isinstance(prompt, str):
            prompt = make_messages(prompt, system_prompt=self.system_prompt, prompt_suffix=self.prompt_suffix)
        return Sample(
            index=group_index,
            group_index=group_index,
            prompt=prompt,
            label=row[self.label_key],
            metadata={"data_index": index, "source": self.path.name},
        )
