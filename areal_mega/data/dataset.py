"""Prompt datasets: local JSONL / parquet files of prompts with reference answers.

    ds = PromptDataset.from_config(cfg.data, tokenizer)        # or PromptDataset(path, tok, ...)
    loader = PromptLoader(ds, batch_size=16, seed=cfg.seed)
    for batch in loader.batches():   # list of PromptItem, endless over epochs
        ...
    state = loader.state_dict()      # plain JSON; PromptLoader(...).load_state_dict(state)
                                     # continues with exactly the batch that would have come next

Each record holds a prompt under ``prompt_key`` (a string, or a list of chat messages
``[{"role": ..., "content": ...}]``) and a reference answer under ``answer_key`` (any JSON
value; it is handed to the reward function unchanged). The prompt is rendered with the model
tokenizer's chat template when ``apply_chat_template`` is set, else used as raw text, then
tokenized; prompts longer than ``max_prompt_len`` tokens are dropped and counted. A prompt with
images (vision-language models, :mod:`areal_mega.data.vision_prompts`) is tokenized with each
image's placeholder expanded to its image tokens; its images are encoded when it is drawn
(:meth:`PromptDataset.prompt_fields`).

Shuffling is a pure function of ``(seed, epoch)``, so a resumed run replays the same order.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from areal_mega.data.errors import DataError
from areal_mega.data.hf import is_hf_source, read_hf
from areal_mega.data.vision_prompts import VisionPrompts, has_images, raw_text

log = logging.getLogger(__name__)

PARQUET_SUFFIXES = (".parquet", ".pq")


# ----------------------------------------------------------------------------- reading files


def detect_format(path: str | Path, fmt: str = "auto") -> str:
    """``jsonl``, ``parquet`` or ``hf``: ``fmt`` unless ``auto``, else ``hf`` for an HF
    dataset (:func:`areal_mega.data.hf.is_hf_source`) or by the file suffix."""

    if fmt not in ("auto", "jsonl", "parquet", "hf"):
        raise DataError(f"data.format={fmt!r}: must be one of ['auto', 'jsonl', 'parquet']")
    if fmt == "hf" or is_hf_source(str(path)):
        return "hf"
    if fmt != "auto":
        return fmt
    return "parquet" if Path(path).suffix.lower() in PARQUET_SUFFIXES else "jsonl"


def read_jsonl(path: str | Path) -> list[dict]:
    """Read one JSON object per line; blank lines are skipped. Errors name file and line."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"dataset file {str(p)!r}: not found")
    rows = []
    with p.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{p}:{lineno}: invalid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise DataError(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            obj["__line__"] = lineno
            rows.append(obj)
    return rows


def read_parquet(path: str | Path) -> list[dict]:
    """Read a parquet file with pyarrow (imported lazily; ``pip install pyarrow``)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"dataset file {str(p)!r}: not found")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"dataset file {str(p)!r}: reading parquet needs the 'pyarrow' package "
            "(pip install pyarrow, pinned in requirements.txt), or convert the file "
            "to JSONL"
        ) from None
    rows = pq.read_table(p).to_pylist()
    for i, row in enumerate(rows):
        row["__line__"] = i  # parquet rows are 0-based "row N"
    return rows


def read_records(path: str | Path, fmt: str = "auto") -> list[dict]:
    """Read every record of a JSONL or parquet file (see :func:`detect_format`)."""

    kind = detect_format(path, fmt)
    if kind == "hf":
        return read_hf(str(path))
    return read_parquet(path) if kind == "parquet" else read_jsonl(path)


def _where(path, kind: str, row: dict) -> str:
    n = row.get("__line__")
    return f"{path}:{n}" if kind == "jsonl" else f"{path} row {n}"


# ----------------------------------------------------------------------------- the dataset


@dataclass
class PromptItem:
    """One prompt ready for rollout."""

    index: int  # position in the filtered dataset (stable across runs)
    prompt: str  # rendered prompt text (after the chat template)
    input_ids: list[int]  # tokenized prompt
    answer: Any  # the reference answer, unchanged
    meta: dict = field(default_factory=dict)  # the record's other fields
    # a prompt with images: what VisionPrompts.inputs needs to encode them (record prompt,
    # images, folder, where, rendered text); None for a text prompt
    vision: Optional[dict] = None


def render_prompt(tokenizer, prompt: Any, apply_chat_template: bool, where: str = "") -> str:
    """Turn a record's prompt (string or message list) into the text the model sees."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        messages = prompt
    else:
        raise DataError(
            f"{where}: prompt must be a string or a list of {{role, content}} "
            f"messages, got {type(prompt).__name__}"
        )
    if not apply_chat_template:
        if isinstance(prompt, str):
            return prompt
        raise DataError(
            f"{where}: the prompt is a message list; set data.apply_chat_template"
            "=true (raw text needs a string prompt)"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.apply_chat_template=true but the tokenizer has no chat_template; "
            "set data.apply_chat_template=false to use raw prompt text"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class PromptDataset:
    """Prompts with reference answers from a local JSONL / parquet file, tokenized up front.

    Args:
        path: the file. ``fmt``: ``auto`` | ``jsonl`` | ``parquet``.
        tokenizer: a HF tokenizer (its chat template is used when ``apply_chat_template``).
        prompt_key / answer_key: field names (``data.prompt_key`` / ``data.answer_key``).
        max_prompt_len: longer prompts (in tokens) are dropped; ``n_dropped`` counts them.
        vision: the image side (model's image processor, ``data.images.*``); a record with
            images skipped by its policy is counted in ``n_bad_images``.
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        apply_chat_template: bool = True,
        max_prompt_len: int = 1024,
        fmt: str = "auto",
        vision: Optional[VisionPrompts] = None,
    ):
        self.path = str(path)
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.tokenizer = tokenizer
        self.vision = vision or VisionPrompts()
        kind = detect_format(path, fmt)
        rows = read_records(path, kind)
        base_dir = Path(path).parent
        skipped_before = self.vision.policy.skipped  # a policy may serve several files
        texts, kept, ids, sources = [], [], [], []
        for row in rows:
            where = _where(path, kind, row)
            for key, cfg_key in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
                if key not in row:
                    fields = sorted(k for k in row if k != "__line__")
                    raise DataError(
                        f"{where}: missing field {key!r} ({cfg_key}); the record has {fields}"
                    )
            prompt, source, tok_ids = row[prompt_key], None, None
            if has_images(prompt, self.vision.record_images(row)):
                got = self.vision.admit(row, prompt, base_dir=base_dir, where=where)
                if got is None:  # a bad image, skipped by data.images.on_bad=skip
                    continue
                messages, images = got
                if apply_chat_template or not isinstance(prompt, str):
                    text = render_prompt(tokenizer, messages, apply_chat_template, where)
                else:
                    text = raw_text(messages)
                tok_ids = self.vision.encode(text, images, tokenizer, where).input_ids.tolist()
                source = {
                    "prompt": prompt,
                    "images": self.vision.record_images(row),
                    "base_dir": str(base_dir),
                    "where": where,
                    "text": text,
                }
            else:
                text = render_prompt(tokenizer, prompt, apply_chat_template, where)
            texts.append(text)
            ids.append(tok_ids)
            sources.append(source)
            kept.append(row)
        plain = [i for i, t in enumerate(ids) if t is None]
        if plain:
            enc = tokenizer([texts[i] for i in plain], add_special_tokens=False)["input_ids"]
            for i, tok_ids in zip(plain, enc):
                ids[i] = tok_ids
        self.items: list[PromptItem] = []
        self.n_bad_images = self.vision.policy.skipped - skipped_before
        self.n_total = len(kept) + self.n_bad_images
        self.n_dropped = 0
        for row, text, tok_ids, source in zip(kept, texts, ids, sources):
            if len(tok_ids) > max_prompt_len:
                self.n_dropped += 1
                continue
            meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
            self.items.append(
                PromptItem(len(self.items), text, list(tok_ids), row[answer_key], meta, source)
            )
        if self.n_bad_images:
            log.warning(
                "%s: skipped %d of %d records with a bad image (data.images.on_bad=skip); "
                "first: %s",
                self.path,
                self.n_bad_images,
                self.n_total,
                "; ".join(self.vision.policy.reasons),
            )
        if self.n_dropped:
            log.warning(
                "%s: dropped %d of %d prompts longer than data.max_prompt_len=%d tokens",
                self.path,
                self.n_dropped,
                self.n_total,
                max_prompt_len,
            )
        if not self.items:
            raise DataError(
                f"dataset file {self.path!r}: no usable prompts ({self.n_total} "
                f"records, {self.n_dropped} longer than max_prompt_len="
                f"{max_prompt_len}, {self.n_bad_images} with a bad image)"
            )

    @classmethod
    def from_config(
        cls, data_cfg, tokenizer, split: str = "train", model_dir: Optional[str] = None
    ) -> "PromptDataset":
        """Build from a ``DataConfig``; ``split`` is ``train`` (train_path) or ``test``;
        ``model_dir``: the model whose image processor encodes images (``data.images.*``)."""
        key = {"train": "train_path", "test": "test_path"}.get(split)
        if key is None:
            raise DataError(f"split={split!r}: must be 'train' or 'test'")
        path = getattr(data_cfg, key)
        if not path:
            raise DataError(f"data.{key} is empty; point it at a JSONL or parquet file")
        prompt_key, answer_key = field_keys(data_cfg, {})
        return cls(
            path,
            tokenizer,
            prompt_key=prompt_key,
            answer_key=answer_key,
            apply_chat_template=data_cfg.apply_chat_template,
            max_prompt_len=data_cfg.max_prompt_len,
            fmt=data_cfg.format,
            vision=VisionPrompts.from_config(data_cfg, model_dir),
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    def prompt_fields(self, i: int) -> dict:
        """Prompt ``i`` as a workflow's item: ``input_ids``, ``prompt`` (rendered text),
        ``answer``, the record's scalar fields and, for a prompt with images, ``multimodal``
        and ``image_data`` (:meth:`VisionPrompts.inputs`: the images decoded and encoded
        now, once for every sample of the prompt's group)."""
        it = self.items[i]
        out = {
            "input_ids": it.input_ids,
            "prompt": it.prompt,
            "answer": it.answer,
            **{k: v for k, v in it.meta.items() if isinstance(v, (str, int, float, bool))},
        }
        if it.vision is not None:
            out.update(self.vision.inputs(it.vision, self.tokenizer))
        return out


def field_keys(data_cfg, fields: dict, where: str = "data.fields") -> tuple[str, str]:
    """The (prompt, answer) record field names: ``fields`` (a source's own mapping), else
    ``data.fields``, else ``data.prompt_key`` / ``data.answer_key``."""
    mapping = fields or data_cfg.fields
    if not fields:
        where = "data.fields"
    bad = sorted(set(mapping) - {"prompt", "answer"})
    if bad:
        raise DataError(
            f"{where}.{bad[0]}: unknown key; a field mapping names 'prompt' and 'answer'"
        )
    for k, v in mapping.items():
        if not isinstance(v, str) or not v:
            raise DataError(f"{where}.{k}={v!r}: expected a record field name")
    return mapping.get("prompt", data_cfg.prompt_key), mapping.get("answer", data_cfg.answer_key)


# ----------------------------------------------------------------------------- order and resume


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The visiting order of epoch ``epoch``: a pure function of ``(n, seed, epoch)``."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n)


class PromptSampler:
    """Endless batches of indices over epochs, shuffled per epoch, resumable exactly.

    The state is ``(epoch, offset)`` plus the settings it depends on; ``load_state_dict``
    refuses a state from a different dataset size, seed or batch size, since the order would
    silently differ.
    """

    def __init__(
        self, n: int, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True
    ):
        if n < 1:
            raise DataError("PromptSampler: the dataset is empty")
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size}: must be >= 1")
        if drop_last and batch_size > n:
            raise DataError(
                f"batch_size={batch_size} is larger than the dataset ({n} prompts) "
                "with data.drop_last=true: no batch could be formed"
            )
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.offset, self.batches_served = 0, 0, 0
        self._perm = epoch_permutation(n, seed, 0, shuffle)

    def _set_epoch(self, epoch: int) -> None:
        self.epoch, self.offset = epoch, 0
        self._perm = epoch_permutation(self.n, self.seed, epoch, self.shuffle)

    def next_indices(self) -> list[int]:
        """The next batch of dataset indices (moves to the next epoch when one runs out)."""
        remaining = self.n - self.offset
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self._set_epoch(self.epoch + 1)
        end = min(self.offset + self.batch_size, self.n)
        out = [int(i) for i in self._perm[self.offset : end]]
        self.offset = end
        self.batches_served += 1
        return out

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "batches_served": self.batches_served,
            "n": self.n,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("n", "batch_size", "seed", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"data state: {key}={state[key]!r} in the checkpoint but "
                    f"{getattr(self, key)!r} now; the prompt order would differ "
                    "(same dataset file, seed and batch size are needed to resume)"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if not 0 <= offset <= self.n:
            raise DataError(f"data state: offset={offset} outside [0, {self.n}]")
        self._set_epoch(epoch)
        self.offset = offset
        self.batches_served = int(state.get("batches_served", 0))


class PromptLoader:
    """A :class:`PromptDataset` + :class:`PromptSampler`: batches of :class:`PromptItem`."""

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        self.dataset = dataset
        self.sampler = PromptSampler(len(dataset), batch_size, seed, shuffle, drop_last)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def next_batch(self) -> list[PromptItem]:
        return [self.dataset[i] for i in self.sampler.next_indices()]

    def batches(self, n: Optional[int] = None) -> Iterator[list[PromptItem]]:
        """Yield ``n`` batches (endless when ``None``)."""
        k = 0
        while n is None or k < n:
            yield self.next_batch()
            k += 1

    def state_dict(self) -> dict:
        return {
            "sampler": self.sampler.state_dict(),
            "path": self.dataset.path,
            "n_dropped": self.dataset.n_dropped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])


def load_tokenizer(model_path: str):
    """The tokenizer of an HF model directory (local files only)."""
    from transformers import AutoTokenizer

    if not Path(model_path).is_dir():
        raise DataError(f"model.path={model_path!r}: not a directory with tokenizer files")
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


__all__: Sequence[str] = (
    "DataError",
    "PromptDataset",
    "PromptItem",
    "PromptLoader",
    "PromptSampler",
    "epoch_permutation",
    "field_keys",
    "load_tokenizer",
    "read_records",
    "read_jsonl",
    "read_parquet",
    "detect_format",
    "render_prompt",
)
