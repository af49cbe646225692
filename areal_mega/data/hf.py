"""Hugging Face ``datasets`` as prompt sources (needs the ``datasets`` package).

Two spellings of a source path:

- ``hf:owner/name[:config][@split]``: ``datasets.load_dataset(owner/name, config,
  split=split)`` (split defaults to ``train``; it uses the HF cache and hub like any
  ``load_dataset`` call);
- a local directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
  (``dir`` or ``dir@split``; a ``DatasetDict`` needs the split, default ``train``).

Rows come back as plain dicts with ``__line__`` = the row number, like the JSONL/parquet
readers of :mod:`areal_mega.data.dataset`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from areal_mega.data.errors import DataError

HF_PREFIX = "hf:"


def _split_suffix(spec: str) -> tuple[str, Optional[str]]:
    base, sep, split = spec.rpartition("@")
    return (base, split or None) if sep and base else (spec, None)


def is_hf_source(path: str) -> bool:
    """True for ``hf:...`` or a saved-dataset directory (optionally with ``@split``)."""
    if path.startswith(HF_PREFIX):
        return True
    base, _ = _split_suffix(path)
    p = Path(base)
    return p.is_dir() and any(
        (p / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def parse_hf_spec(spec: str) -> tuple[str, Optional[str], str]:
    """``hf:owner/name[:config][@split]`` -> (name, config or None, split)."""

    if not spec.startswith(HF_PREFIX):
        raise DataError(f"{spec!r}: an HF dataset is written hf:owner/name[:config][@split]")
    body, split = _split_suffix(spec[len(HF_PREFIX) :])
    name, _, config = body.partition(":")
    if not name:
        raise DataError(f"{spec!r}: missing the dataset name after 'hf:'")
    return name, config or None, split or "train"


def read_hf(path: str) -> list[dict]:
    """Every row of an HF dataset (hub spec or saved directory) as a dict."""

    try:
        import datasets
    except ImportError:
        raise DataError(
            f"dataset {path!r}: reading an HF dataset needs the 'datasets' package "
            "(pip install datasets, pinned in requirements.txt)"
        ) from None
    if path.startswith(HF_PREFIX):
        name, config, split = parse_hf_spec(path)
        ds = datasets.load_dataset(name, config, split=split)
    else:
        base, split = _split_suffix(path)
        ds = datasets.load_from_disk(base)
        if isinstance(ds, datasets.DatasetDict):
            split = split or "train"
            if split not in ds:
                raise DataError(
                    f"dataset directory {base!r}: no split {split!r}; it has "
                    f"{sorted(ds)} (write {base}@<split>)"
                )
            ds = ds[split]
        elif split is not None:
            raise DataError(f"dataset directory {base!r} holds one split; drop '@{split}'")
    rows = ds.to_list()
    for i, row in enumerate(rows):
        row["__line__"] = i
    return rows
