"""bench/vs_trl.py's assets: a Llama with random weights (the 135M shape, or the demo's tiny one
that learns the task within a run), its tokenizer and the prompt files (both sides read the
same ones)."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the demo's model (areal_mega/demo.py) over the digits charset alone: 3 special tokens + 19
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=256, vocab_size=22)


def build_tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` ids: ``<pad>``, ``<eos>``,
    ``<unk>``, the ``digits`` charset of areal_mega.models.tiny (one id per character; text is
    split into characters), then digit strings of 2, 3, 4 and 5 characters in order."""
    from itertools import product

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from areal_mega.models.tiny import CHARSETS, SPECIAL_TOKENS
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSETS["digits"]:
        vocab.setdefault(ch, len(vocab))
    for n in range(2, 6):
        for digits in product("0123456789", repeat=n):
            if len(vocab) == vocab_size:
                break
            vocab["".join(digits)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def make_assets(out: Path, layers: int, seed: int, instruction: int = 0,
                shape_name: str = "135m") -> tuple:
    """The model directory (random weights, fp32, tokenizer; ``shape_name`` 135m or tiny, with
    ``layers`` layers) and the prompt files, each prompt after the same ``instruction``
    characters (digits)."""
    import random
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from areal_mega.data.synthetic import write_task_files
    sys.path.insert(0, str(ROOT / "bench"))
    from engine import SHAPE

    shape = {k: v for k, v in SHAPE.items() if k not in ("model_type", "architectures")}
    shape.update(TINY if shape_name == "tiny" else {})
    tok = build_tokenizer(shape["vocab_size"])
    shape.update(num_hidden_layers=layers, bos_token_id=None, eos_token_id=tok.eos_token_id,
                 pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    write_task_files(out / "data", task="reverse", n_train=2048, n_test=32, seed=seed)
    head = "".join(random.Random(seed).choices("0123456789", k=instruction))
    for name in ("train.jsonl", "test.jsonl"):    # one answer for every prompt
        p = out / "data" / name
        rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        p.write_text("".join(json.dumps(dict(r, prompt=head + r["prompt"], answer="0000"))
                             + "\n" for r in rows))
    return out / "model", out / "data"
