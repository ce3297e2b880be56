"""Prompts from local JSONL or Parquet files, validated row by row so a bad row names its file and line."""

from __future__ import annotations

import base64
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


IMAGE_MARKER = "<image>"  # where a text question places its images (LLaVA / geo3k style)


def row_problem(row: Any, *, prompt_key: str, label_key: str, image_key: str = "") -> str | None:
    """Why a row cannot become a prompt, or None if it can.

    A usable row is a mapping whose ``prompt_key`` is a non-blank string or a non-empty list of chat messages
    (``{"role": str, "content": str | list of parts}``) and whose ``label_key`` is present and not null; with
    ``image_key``, that column holds one image or a list of them (``image_entries``), as many as the messages' image
    parts when the prompt is messages.
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
            content = message.get("content") if isinstance(message, dict) else None
            parts = isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content)
            if not ok or not (isinstance(content, str) or parts):
                return f"{prompt_key!r} holds {message!r:.80}, expected messages {{'role': str, 'content': str}}"
    else:
        return f"{prompt_key!r} is a {type(prompt).__name__} ({prompt!r:.40}), expected a string or chat messages"
    if row[label_key] is None:
        return f"{label_key!r} is null"
    if image_key:
        if image_key not in row:
            return f"missing key {image_key!r} (data.image_key); row has keys {sorted(row)[:8]}"
        try:
            images = image_entries(row[image_key])
        except ValueError as err:
            return f"{image_key!r}: {err}"
        if isinstance(prompt, list):
            from miles.rollout.multimodal import count_image_parts

            if count_image_parts(prompt) != len(images):
                return f"{prompt_key!r} has {count_image_parts(prompt)} image parts but {image_key!r} has {len(images)}"
    return None


def image_entries(value: Any) -> list[str | bytes]:
    """A row's image column as a list: each a path or base64 text, or raw bytes (a ``datasets`` image record
    ``{"bytes": ..., "path": ...}`` gives its bytes, else its path). An empty list is a text-only row.

    Raises: ValueError for another type.
    """
    items = value if isinstance(value, list | tuple) else [value]
    entries: list[str | bytes] = []
    for item in items:
        if isinstance(item, dict) and (item.get("bytes") or item.get("path")):
            item = item.get("bytes") or item["path"]
        if not isinstance(item, str | bytes | bytearray) or not item:
            raise ValueError(f"holds {item!r:.40}; expected image paths, base64 text, bytes or {{bytes, path}} records")
        entries.append(bytes(item) if isinstance(item, bytearray) else item)
    return entries


def image_messages(
    question: str, num_images: int, *, system_prompt: str | None, prompt_suffix: str
) -> list[dict[str, Any]]:
    """``make_messages`` for a question with images: the user content is parts, one ``{"type": "image"}`` per image
    at the question's ``<image>`` markers when it has exactly ``num_images`` of them, else all before the text."""
    if num_images and question.count(IMAGE_MARKER) == num_images:
        pieces = question.split(IMAGE_MARKER)
    else:
        pieces = [""] * num_images + [question]
    content: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):  # image i sits between pieces i - 1 and i
        if i:
            content.append({"type": "image"})
        text = piece + (prompt_suffix if i == len(pieces) - 1 else "")
        if text:
            content.append({"type": "text", "text": text})
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": content})
    return messages


def is_blank_line(raw: bytes) -> bool:
    """True if a raw JSONL line holds only JSON whitespace (space, tab, CR, LF); such lines are not rows."""
    return not raw.strip(JSON_WHITESPACE)


def read_jsonl_rows(
    path: Path, *, prompt_key: str, label_key: str, image_key: str = ""
) -> tuple[list[dict[str, Any]], list[str]]:
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
            problem = row_problem(row, prompt_key=prompt_key, label_key=label_key, image_key=image_key)
            if problem is None:
                rows.append(row)
            else:
                problems.append(f"{where}: {problem}")
    return rows, problems


def read_parquet_rows(
    path: Path, *, prompt_key: str, label_key: str, image_key: str = ""
) -> tuple[list[dict[str, Any]], list[str]]:
    """Good rows of a Parquet file (through HF ``datasets``) and one ``file:row N: reason`` per bad row."""
    import datasets

    table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    return _table_rows(table, path, prompt_key=prompt_key, label_key=label_key, image_key=image_key)


def read_saved_dataset_rows(
    path: Path, *, prompt_key: str, label_key: str, image_key: str = ""
) -> tuple[list[dict[str, Any]], list[str]]:
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
    dataset = datasets.load_from_disk(str(path))
    return _table_rows(dataset, path, prompt_key=prompt_key, label_key=label_key, image_key=image_key)


def _table_rows(
    table: Any, path: Path, *, prompt_key: str, label_key: str, image_key: str = ""
) -> tuple[list[dict[str, Any]], list[str]]:
    rows, problems = [], []
    for number, row in enumerate(table):
        problem = row_problem(row, prompt_key=prompt_key, label_key=label_key, image_key=image_key)
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
    image_key: str = "",
) -> tuple[list[dict[str, Any]], list[str]]:
    """The usable rows of a JSONL/Parquet file, every row validated (see ``row_problem``).

    Bad rows either stop with one message listing the first few as ``file:line[:column]: reason``
    (``bad_rows="stop"``) or are left out with one warning (``"skip"``).

    Args:
        path: the file (``.jsonl``, ``.json`` (JSON lines) or ``.parquet``), or a directory written by HF
            ``datasets``' ``save_to_disk`` (one split).
        prompt_key, label_key: the columns of the question and the reference answer.
        bad_rows: "stop" or "skip", see above.
        image_key: the column of each row's images ("" = none), see ``row_problem``.
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
    rows, problems = read(path, prompt_key=prompt_key, label_key=label_key, image_key=image_key)
    listed = "; ".join(problems[:_NUM_LISTED]) + (
        f"; and {len(problems) - _NUM_LISTED} more" if len(problems) > _NUM_LISTED else ""
    )
    for column, field in ((prompt_key, "prompt_key"), (label_key, "label_key"), (image_key, "image_key")):
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
    unused = [column for column in _IMAGE_COLUMNS if column in rows[0]] if not image_key else []
    if unused:  # an images column the config does not name: the rows would train text-only, silently
        logger.warning(
            "%s: the rows have a %r column but data.image_key is empty, so their images are not used (text-only "
            "prompts); pass --data.image-key %s to give them to a vision-language policy",
            path,
            unused[0],
            unused[0],
        )
    return rows, problems


_IMAGE_COLUMNS = ("images", "image")
"""Column names that hold images in common VLM datasets (LLaVA-style, HF ``datasets`` image features)."""


class FileSource(EpochShuffledSource):
    """``DataSource`` over a local JSONL/Parquet file; rows are reshuffled every epoch with a seeded order.

    Every row is validated at construction (``load_rows``); bad rows stop the run or are skipped and counted.
    With ``num_heldout`` the source keeps that many rows (a fixed, seed-independent choice) out of training;
    ``heldout_source`` serves them, so the eval prompts are never trained on.

    Args:
        path: the file (``.jsonl``, ``.json`` (JSON lines) or ``.parquet``).
        prompt_key: column with the question text (or a list of chat messages).
        label_key: column with the reference answer (e.g. GSM8K's "answer" ending in ``#### 42``).
        image_key: column with each row's images ("" = text-only rows): a text question becomes a user message
            with one image part per image (``image_messages``); the images go to ``metadata["images"]`` as absolute
            paths (relative ones resolved against the file's directory) or base64 text (bytes), JSON-able.
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
        image_key: str = "",
    ) -> None:  # rows: already loaded rows (then path only names them)
        path = Path(path)
        problems: list[str] = []
        if rows is None:
            rows, problems = load_rows(path, prompt_key=prompt_key, label_key=label_key, bad_rows=bad_rows, key=key,
                                       image_key=image_key)  # fmt: skip
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
        self.image_key = image_key
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
            image_key=self.image_key,
        )

    @property
    def size(self) -> int:
        return len(self.rows)

    def sample_at(self, index: int, group_index: int) -> Sample:
        row = self.rows[index]
        prompt = row[self.prompt_key]
        metadata: dict[str, Any] = {"data_index": index, "source": self.path.name}
        images = image_entries(row[self.image_key]) if self.image_key else []
        if images:
            metadata["images"] = [self._image_text(entry) for entry in images]
        if isinstance(prompt, str) and images:
            prompt = image_messages(prompt, len(images), system_prompt=self.system_prompt,
                                    prompt_suffix=self.prompt_suffix)  # fmt: skip
        elif isinstance(prompt, str):
            prompt = make_messages(prompt, system_prompt=self.system_prompt, prompt_suffix=self.prompt_suffix)
        return Sample(index=group_index, group_index=group_index, prompt=prompt, label=row[self.label_key],
                      metadata=metadata)  # fmt: skip

    def _image_text(self, entry: str | bytes) -> str:
        """A JSON-able ``metadata["images"]`` entry: bytes as base64 text; a path made absolute against the data
        file's directory when that file exists there; other text (base64, an absolute path) as is."""
        if isinstance(entry, bytes):
            return base64.b64encode(entry).decode("ascii")
        from miles.rollout.multimodal import is_file_path

        if not Path(entry).is_absolute() and is_file_path(self.path.parent / entry):
            return str((self.path.parent / entry).resolve())
        return entry
