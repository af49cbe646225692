"""Prompt datasets (JSONL / parquet, chat templates, resumable shuffling) and synthetic tasks."""
from areal_mega.data.dataset import (DataError, PromptDataset, PromptItem, PromptLoader,
                                     PromptSampler, epoch_permutation, load_tokenizer,
                                     read_records)
from areal_mega.data.synthetic import write_task_files

__all__ = ["DataError", "PromptDataset", "PromptItem", "PromptLoader", "PromptSampler",
           "epoch_permutation", "load_tokenizer", "read_records", "write_task_files"]
