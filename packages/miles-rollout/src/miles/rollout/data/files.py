"""Prompts from local JSONL or Parquet files, read through HF ``datasets``."""

from __future__ import annotations

from pathlib import Path

from miles.core.sample import Sample
from miles.rollout.data.epoch import EpochShuffledSource
from miles.rollout.data.reasoning_gym import make_messages

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class FileSource(EpochShuffledSource):
    """``DataSource`` over a local JSONL/Parquet file; rows are reshuffled every epoch with a seeded order.

    Args:
        path: the file (``.jsonl``, ``.json`` or ``.parquet``).
        prompt_key: column with the question text (or a list of chat messages).
        label_key: column with the reference answer (e.g. GSM8K's "answer" ending in ``#### 42``).
        seed: shuffle seed; system_prompt, prompt_suffix: as in ``make_messages``.
        limit: use only the first ``limit`` rows (0 = all).
    Raises: FileNotFoundError, or ValueError naming the file and the missing column.
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
    ) -> None:
        import datasets

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"data.path {str(path)!r} does not exist; point --data.path at a JSONL/Parquet file"
            )
        if path.suffix not in _FORMATS:
            raise ValueError(f"data.path {str(path)!r}: unsupported suffix {path.suffix!r}; use .jsonl or .parquet")
        table = datasets.load_dataset(_FORMATS[path.suffix], data_files=str(path), split="train")
        for key, field in ((prompt_key, "prompt_key"), (label_key, "label_key")):
            if key not in table.column_names:
                flag = "--data." + field.replace("_", "-")
                columns = table.column_names
                raise ValueError(f"data.{field} is {key!r}, but {path.name} has columns {columns}; set {flag}")
        if limit:
            table = table.select(range(min(limit, len(table))))
        self.rows = table
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
