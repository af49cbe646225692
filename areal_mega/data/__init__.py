"""Prompt datasets (JSONL / parquet, chat templates, resumable shuffling) and synthetic tasks.

- :mod:`.dataset` — :class:`PromptDataset`, its loader and sampler: records tokenized, in a
  resumable order;
- :mod:`.sources` — several sources (``data.sources``) drawn by weight, resumably;
- :mod:`.hf` — Hugging Face ``datasets`` as prompt sources (``hf:owner/name``, saved
  directories);
- :mod:`.synthetic` — the CPU demo's verifiable tasks, written as JSONL files;
- :mod:`.images` — images in prompt records (chat image parts, ``<image>`` markers), read
  and checked where they enter;
- :mod:`.vision_prompts` — image records rendered and image-expanded at load, their images
  encoded when a prompt is drawn (pixels for the trainer, PNG data URLs for the server);
- :mod:`.synthetic_vision` — synthetic visual tasks (count the shapes, name the colour),
  drawn here;
- :mod:`.errors` — :class:`DataError`, the one error type of this layer.
"""

from areal_mega.data.dataset import (
    DataError,
    PromptDataset,
    PromptItem,
    PromptLoader,
    PromptSampler,
    epoch_permutation,
    load_tokenizer,
    read_records,
)
from areal_mega.data.synthetic import write_task_files

__all__ = [
    "DataError",
    "PromptDataset",
    "PromptItem",
    "PromptLoader",
    "PromptSampler",
    "epoch_permutation",
    "load_tokenizer",
    "read_records",
    "write_task_files",
]
