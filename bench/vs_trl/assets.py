"""bench/vs_trl/run.py's assets: a Llama with random weights (the 135M shape, or the demo's tiny one
that learns the task within a run), its tokenizer and the prompt files (both sides read the
same ones)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the demo's model (areal_mega/demo.py) over the digits charset alone: 3 special tokens + 19
TINY = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=256,
    vocab_size=22,
)


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
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def make_assets(
    out: Path, layers: int, seed: int, instruction: int = 0, shape_name: str = "135m"
) -> tuple:
    """The model directory (random weights, fp32, tokenizer; ``shape_name`` 135m or tiny, with
    ``layers`` layers) and the prompt files, each prompt after the same ``instruction``
    characters (digits)."""
    import random

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from areal_mega.data.synthetic import write_task_files
    from bench.engine import SHAPE

    shape = {k: v for k, v in SHAPE.items() if k not in ("model_type", "architectures")}
    shape.update(TINY if shape_name == "tiny" else {})
    tok = build_tokenizer(shape["vocab_size"])
    shape.update(
        num_hidden_layers=layers,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    write_task_files(out / "data", task="reverse", n_train=2048, n_test=32, seed=seed)
    head = "".join(random.Random(seed).choices("0123456789", k=instruction))
    for name in ("train.jsonl", "test.jsonl"):  # one answer for every prompt
        p = out / "data" / name
        rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        if name == "train.jsonl":  # the reverse task's own answers, for SFT
            (out / "data" / "sft.jsonl").write_text(
                "".join(json.dumps(dict(r, prompt=head + r["prompt"])) + "\n" for r in rows)
            )
        p.write_text(
            "".join(
                json.dumps(dict(r, prompt=head + r["prompt"], answer="0000")) + "\n" for r in rows
            )
        )
    return out / "model", out / "data"


def warm_start(
    out: Path,
    model: Path,
    data: Path,
    steps: int,
    env: dict,
    seed: int,
    lr: float,
    max_prompt_len: int,
) -> Path:
    """A model that answers like the RL task wants before RL starts: ``steps`` of our SFT
    (``mode=sft``, 64 examples a step) on the reverse task's own answers (``sft.jsonl``: five
    digits and EOS), from the random weights. RL then has a reward to climb (char_match
    towards ``0000`` pays per matching digit), where the random model's 16 tokens of 2-5
    digits each score ~0.007 on both sides and stay flat. ``env``: the processes' environment
    (threads). Returns the SFT'd HF directory; one that ``out`` already holds from the same
    work (the model's config and the SFT file's contents, the seed that made the weights,
    steps, lr) is reused, and one of other work is replaced."""
    import hashlib
    import shutil
    import subprocess

    run = out / "sft"
    stamp = run / "warm_start.json"
    work = {
        "config": json.loads((model / "config.json").read_text()),
        "sft_data": hashlib.sha256((data / "sft.jsonl").read_bytes()).hexdigest(),
        "seed": seed,
        "steps": steps,
        "lr": lr,
    }
    if (
        (run / "hf_model" / "config.json").exists()
        and stamp.exists()
        and json.loads(stamp.read_text()) == work
    ):
        print(f"[vs_trl] SFT warm start: reusing {run / 'hf_model'} (same work)", flush=True)
        return run / "hf_model"
    if run.exists():  # another work's (or an unfinished) warm start: redo it
        print(f"[vs_trl] SFT warm start: replacing {run} (other work)", flush=True)
        shutil.rmtree(run)
    cmd = [
        sys.executable,
        "-m",
        "areal_mega.trainer",
        "--config",
        str(ROOT / "recipes" / "tiny-cpu.yaml"),
        "mode=sft",
        "model_hparams=null",
        f"model.path={model}",
        f"logging.run_dir={run}",
        f"total_steps={steps}",
        f"optimizer.lr={lr}",
        "optimizer.warmup_steps=0",
        "recover=off",
        f"data.train_path={data / 'sft.jsonl'}",
        f"data.test_path={data / 'test.jsonl'}",
        f"data.max_prompt_len={max_prompt_len}",
        "checkpoint.save_every=0",
        "logging.progress_bar=true",
        "logging.tensorboard=false",
        "logging.plot=false",
        f"seed={seed}",
    ]
    from areal_mega.common.net import free_port

    env = dict(env, MASTER_PORT=str(free_port()))
    with (out / "sft.log").open("w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not (run / "hf_model" / "config.json").exists():
        raise SystemExit(f"the SFT warm start failed (exit {rc}); see {out / 'sft.log'}")
    stamp.write_text(json.dumps(work))
    return run / "hf_model"
