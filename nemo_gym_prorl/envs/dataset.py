"""Task instances from any local JSONL or parquet file, read through Hugging Face `datasets`."""

from __future__ import annotations

from pathlib import Path

import datasets

from nemo_gym_prorl.contracts.task import DatasetConfig, TaskInstance

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_instances(config: DatasetConfig, limit: int | None = None) -> list[TaskInstance]:
    path = Path(config.path)
    builder = _BUILDERS.get(path.suffix)
    if builder is None:
        raise ValueError(f"dataset {path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    datasets.disable_progress_bars()
    rows = datasets.load_dataset(builder, data_files=str(path), split="train")
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    if config.id_key and config.id_key not in rows.column_names:
        columns = ", ".join(rows.column_names)
        raise ValueError(f"dataset {path}: no column {config.id_key!r} (its id_key); its columns: {columns}")
    return [
        TaskInstance(instance_id=str(row[config.id_key]) if config.id_key else str(i), data=dict(row))
        for i, row in enumerate(rows)
    ]
