"""Prompts from local JSONL or Parquet files, validated row by row so a bad row names its file and line."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Literal

from miles.core.sample import Sample
from miles.rollout.data.epoch import EpochShuffledSource, make_messages

logger = logging.getLogger(__name__)

_SUFFIXES = (".jsonl", ".json", ".parquet")
# JSON's own whitespace (RFC 8259, section 2). A line holding only these is blank and skipped; any other line,
# including one of control characters such as 0x1C that ``str.strip`` would also remove, is a row and is checked.
JSON_WHITESPACE = b" \t\r\n"
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


def is_blank_line(raw: bytes) -> bool:
    """True if a raw JSONL line holds only JSON whitespace (space, tab, CR, LF); such lines are not rows."""
    return not raw.strip(JSON_WHITESPACE)


def read_jsonl_rows(path: Path, *, prompt_key: str, label_key: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Good rows of a JSONL file and one ``file:line[:column]: reason`` string per bad line.

    Lines are split on LF only (CRLF files work: the CR is JSON whitespace). A line is blank, and skipped, exactly
    when ``is_blank_line`` says so; every other line is a row, decoded as UTF-8 and parsed on its own, so one
    broken line never hides the others. Columns are 1-based characters of that line.
    """
    rows, problems = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path.name}:{number}"
            if is_blank_line(raw):
                continue
            try:
                line = raw.decode("utf-8").rstrip("\r\n")  # the line break is not part of the row (columns)
            except UnicodeDecodeError as err:
                problems.append(f"{where}: not UTF-8 ({err.reason} at byte {err.start + 1})")
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                problems.append(f"{where}:{err.colno}: not JSON ({err.msg} at column {err.colno})")
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
    return _table_rows(table, path, prompt_key=prompt_key, label_key=label_key)


def read_saved_dataset_rows(path: Path, *, prompt_key: str, label_key: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Good rows of an HF ``datasets`` directory written by ``Dataset.save_to_disk`` (``datasets.load_from_disk``)
    and one ``dir:row N: reason`` per bad row.

    Raises: ValueError naming the splits when ``path`` holds a ``DatasetDict`` (point at one split's directory).
    """
    import datasets

    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise ValueError(
            f"{str(path)!r} is a DatasetDict with splits {splits}; point at one split's directory, e.g. "
            f"{str(path / (splits[0] if splits else 'train'))!r}"
        )
    return _table_rows(datasets.load_from_disk(str(path)), path, prompt_key=prompt_key, label_key=label_key)


def _table_rows(table: Any, path: Path, *, prompt_key: str, label_key: str) -> tuple[list[dict[str, Any]], list[str]]:
    rows, problems = [], []
    for number, row in enumerate(table):
        problem = row_problem(row, prompt_key=prompt_key, label_key=label_key)
        if problem is None:
            rows.append(row)
        else:
            problems.append(f"{path.name}:row {number}: {problem}")
    return rows, problems


def load_rows(
    path: str | Path,
    *,
    prompt_key: str = "question",
    label_key: str = "answer",
    bad_rows: Literal["skip", "stop"] = "stop",
    key: str = "data.path",
) -> tuple[list[dict[str, Any]], list[str]]:
    """The usable rows of a JSONL/Parquet file, every row validated (see ``row_problem``).

    Bad rows either stop with one message listing the first few as ``file:line[:column]: reason``
    (``bad_rows="stop"``) or are left out with one warning (``"skip"``).

    Args:
        path: the file (``.jsonl``, ``.json`` (JSON lines) or ``.parquet``), or a directory written by HF
            ``datasets``' ``save_to_disk`` (one split).
        prompt_key, label_key: the columns of the question and the reference answer.
        bad_rows: "stop" or "skip", see above.
        key: the config key that named the file (quoted in errors), e.g. "data.eval_path".
    Returns: (the good rows in file order, one ``file:line[:column]: reason`` per skipped row).
    Raises: FileNotFoundError; ValueError (one line) naming the file and bad rows (stop), a column no row has, or
        a file without a usable row.
    """
    path = Path(path)
    flag = "--" + key.replace("_", "-")
    saved = path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())
    if not (path.is_file() or saved):
        what = "is a directory but no HF dataset (no state.json)" if path.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"{key} {str(path)!r} {what}; point {flag} at a JSONL/Parquet file or a `datasets` save_to_disk directory"
        )
    if not saved and path.suffix not in _SUFFIXES:
        raise ValueError(f"{key} {str(path)!r}: unsupported suffix {path.suffix!r}; use .jsonl or .parquet")
    if saved:
        read = read_saved_dataset_rows
    else:
        read = read_parquet_rows if path.suffix == ".parquet" else read_jsonl_rows
    rows, problems = read(path, prompt_key=prompt_key, label_key=label_key)
    listed = "; ".join(problems[:_NUM_LISTED]) + (
        f"; and {len(problems) - _NUM_LISTED} more" if len(problems) > _NUM_LISTED else ""
    )
    for column, field in ((prompt_key, "prompt_key"), (label_key, "label_key")):
        if not rows and problems and all(f"missing key {column!r}" in problem for problem in problems):
            raise ValueError(
                f"data.{field} is {column!r}, but no row of {path.name} has it ({problems[0]}); set "
                f"--data.{field.replace('_', '-')}"
            )
    if problems and bad_rows == "stop":
        raise ValueError(
            f"{key} {str(path)!r} has {len(problems)} bad row{'s' if len(problems) > 1 else ''} (data.bad_rows is "
            f"'stop'): {listed}. Fix the rows, check --data.prompt-key / --data.label-key, or pass --data.bad-rows "
            "skip to leave them out."
        )
    if not rows:
        detail = f" ({len(problems)} bad: {listed})" if problems else " (the file is empty or blank)"
        raise ValueError(f"{key} {str(path)!r} has no usable row{detail}; point {flag} at a file with rows")
    if problems:
        logger.warning("%s: skipped %d of %d rows (data.bad_rows=skip): %s", path, len(problems),
                       len(problems) + len(rows), listed)  # fmt: skip
    return rows, problems


class FileSource(EpochShuffledSource):
    """``DataSource`` over a local JSONL/Parquet file; rows are reshuffled every epoch with a seeded order.

    Every row is validated at construction (``load_rows``); bad rows stop the run or are skipped and counted.
    With ``num_heldout`` the source keeps that many rows (a fixed, seed-independent choice) out of training;
    ``heldout_source`` serves them, so the eval prompts are never trained on.

    Args:
        path: the file (``.jsonl``, ``.json`` (JSON lines) or ``.parquet``).
        prompt_key: column with the question text (or a list of chat messages).
        label_key: column with the reference answer (e.g. GSM8K's "answer" ending in ``#### 42``).
        seed: shuffle seed; system_prompt, prompt_suffix: as in ``make_messages``.
        limit: use only the first ``limit`` good (training) rows (0 = all).
        bad_rows: "stop" or "skip", see ``load_rows``.
        num_heldout: rows kept out of training for ``heldout_source`` (0 = none).
        key: the config key that named the file, quoted in errors.
    Raises: as ``load_rows``; ValueError when ``num_heldout`` leaves no training row.
    """

    # Fixed seed of the held-out choice: it must not move with data.seed, or a reseeded run would train on the
    # previous run's eval prompts.
    HELDOUT_SEED = 20_251_201

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
        num_heldout: int = 0,
        key: str = "data.path",
        rows: list[dict[str, Any]] | None = None,
    ) -> None:  # rows: already loaded rows (then path only names them)
        path = Path(path)
        problems: list[str] = []
        if rows is None:
            rows, problems = load_rows(path, prompt_key=prompt_key, label_key=label_key, bad_rows=bad_rows, key=key)
        self.num_bad_rows, self.bad_row_reasons = len(problems), problems
        self.heldout_rows: list[dict[str, Any]] = []
        if num_heldout:
            if num_heldout >= len(rows):
                raise ValueError(
                    f"{key} {path.name!r} has {len(rows)} usable rows, too few to hold out {num_heldout} for "
                    "evaluation (eval.num_prompts) and train on the rest; pass --data.eval-path with a separate "
                    "eval file, or lower --eval.num-prompts"
                )
            order = list(range(len(rows)))
            random.Random(self.HELDOUT_SEED).shuffle(order)
            held = set(order[:num_heldout])
            self.heldout_rows = [row for i, row in enumerate(rows) if i in held]
            rows = [row for i, row in enumerate(rows) if i not in held]
        self.rows = rows[:limit] if limit else rows
        self.path, self.prompt_key, self.label_key, self.seed = path, prompt_key, label_key, seed
        self.system_prompt, self.prompt_suffix = system_prompt, prompt_suffix
        self._start()

    def heldout_source(self, *, seed: int) -> FileSource:
        """A source over the rows held out of training (``num_heldout``), shuffled with ``seed``.

        Raises: ValueError if this source holds nothing out.
        """
        if not self.heldout_rows:
            raise ValueError("this FileSource holds no rows out (num_heldout=0)")
        return FileSource(
            self.path,
            prompt_key=self.prompt_key,
            label_key=self.label_key,
            seed=seed,
            system_prompt=self.system_prompt,
            prompt_suffix=self.prompt_suffix,
            rows=self.heldout_rows,
        )

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
