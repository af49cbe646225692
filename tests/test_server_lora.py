"""SGLang's LoRA API on the CPU rollout server, as a real process, with adapters made by the
real ``peft`` package: per-token logprobs equal PeftModel's teacher-forced ones, rows of two
adapters and of the base model share one batch, SGLang's answers to load / unload / errors,
the adapter swap under pause / continue, and no prefix-cache reuse across adapters."""

import asyncio
import json
import shutil
import threading
import time

import pytest
import torch

from areal_mega.inference.process import launch_local_servers
from areal_mega.models.tiny import make_tiny_model
from areal_mega.rollout.client import RolloutClient, RolloutRequestError, sampling_dict
from tests.helpers.rollout import API_KEY, http, load_model, run, teacher_forced_logprobs

pytestmark = pytest.mark.timeout(300)

SERVED_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
TOL = 1e-4  # as the base-model logprob tests of the server


def make_adapter(base, out, r, alpha, targets, seed, **extra):
    """A PEFT LoRA adapter of model ``base`` with random (non-zero) A and B, saved to ``out``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(
        load_model(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, **extra)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return str(out)


def edited_copy(src, dst, **cfg):
    """A copy of adapter ``src`` whose adapter_config.json has ``cfg`` set."""
    shutil.copytree(src, dst)
    f = dst / "adapter_config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **cfg}))
    return str(dst)


@pytest.fixture(scope="module")
def lora_env(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(d / "base", arch="llama", hidden_size=64, num_layers=2, seed=0)
    ad = {
        "a1": make_adapter(base, d / "a1", 8, 16, SERVED_TARGETS, 1),
        "a2": make_adapter(
            base, d / "a2", 4, 8, ["q_proj", "v_proj", "up_proj"], 2, use_rslora=True
        ),
        "a3": make_adapter(base, d / "a3", 2, 4, ["o_proj"], 3),
        "big": make_adapter(base, d / "big", 16, 16, ["q_proj"], 4),
        "down": make_adapter(base, d / "down", 4, 8, ["down_proj"], 5),
    }
    ad["dora"] = edited_copy(ad["a3"], d / "dora", use_dora=True)
    ad["mts"] = edited_copy(ad["a3"], d / "mts", modules_to_save=["lm_head"])
    procs = launch_local_servers(
        str(base),
        1,
        api_key=API_KEY,
        extra_args=[
            "--max-lora-rank",
            "8",
            "--lora-target-modules",
            *SERVED_TARGETS,
            "--lora-paths",
            f"a1={ad['a1']}",
            "--max-loras-per-batch",
            "3",
            "--max-loaded-loras",
            "3",
            "--num-threads",
            "1",
            "--max-context",
            "8192",
            "--lora-allowed-dirs",
            str(d),
        ],
    )
    try:
        yield {"base": base, "ad": ad, "srv": procs[0], "d": d}
    finally:
        for p in procs:
            p.stop()


def peft_model(base, adapter):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_model(base), adapter).eval()


def check(model, prompt, out):
    """``out`` (a /generate answer) has the teacher-forced logprobs of ``model``."""
    got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    ref = teacher_forced_logprobs(model, prompt + out["output_ids"], len(prompt))
    assert len(ref) == len(got) > 0
    assert max(abs(a - b) for a, b in zip(ref, got)) <= TOL
    return ref


def gen(srv, prompts, lora_path, n_new=12, **kw):
    return http(
        srv,
        "/generate",
        {
            "input_ids": prompts,
            "lora_path": lora_path,
            "return_logprob": True,
            **kw,
            "sampling_params": {"max_new_tokens": n_new, "temperature": 1.0, "ignore_eos": True},
        },
    )


def test_mixed_batch_rows_match_their_own_peft_model(lora_env):
    """a1 (preloaded, all served targets), a2 (loaded now, rsLoRA, q/v/up only) and base rows
    in one /generate: each row's logprobs equal its own PeftModel's (or the base model's)."""
    srv, ad, base = lora_env["srv"], lora_env["ad"], lora_env["base"]
    st, out = http(srv, "/load_lora_adapter", {"lora_name": "a2", "lora_path": ad["a2"]})
    assert st == 200 and out == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {"a1": ad["a1"], "a2": ad["a2"]},
    }
    prompts = [[3, 5, 7, 9, 11], [4, 6, 8, 10, 12], [13, 14, 15, 16, 17], [20, 21, 22]]
    names = ["a1", "a2", None, "a1"]
    st, outs = gen(srv, prompts, names)
    assert st == 200, outs
    models = {
        None: load_model(base),
        "a1": peft_model(base, ad["a1"]),
        "a2": peft_model(base, ad["a2"]),
    }
    for p, name, out in zip(prompts, names, outs):
        ref = check(models[name], p, out)
        if name is not None:  # the adapter changes the distribution
            plain = teacher_forced_logprobs(models[None], p + out["output_ids"], len(p))
            assert max(abs(a - b) for a, b in zip(ref, plain)) > 1e-2
    info = http(srv, "/get_server_info")[1]
    assert info["enable_lora"] is True and info["max_lora_rank"] == 8
    assert info["lora_target_modules"] == SERVED_TARGETS and info["max_loras_per_batch"] == 3
    assert info["lora_paths"] == [{"lora_name": "a1", "lora_path": ad["a1"], "pinned": False}]


def test_errors_answer_like_sglang_and_the_server_keeps_serving(lora_env):
    srv, ad = lora_env["srv"], lora_env["ad"]

    def load(name, path):
        st, out = http(srv, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert st == 400 and out["success"] is False, out
        return out["error_message"]

    assert "a1 because it is already loaded" in load("a1", ad["a3"])
    assert "with rank 16 is incompatible" in load("big", ad["big"])
    msg = load("down", ad["down"])
    assert "incompatible" in msg and "down_proj" in msg and "--lora-target-modules" in msg
    assert "DoRA" in load("dora", ad["dora"])
    assert "modules_to_save" in load("mts", ad["mts"])
    assert "adapter_config.json" in load("nowhere", str(lora_env["d"] / "missing"))
    st, out = http(srv, "/unload_lora_adapter", {"lora_name": "ghost"})
    assert st == 400 and out["success"] is False
    assert out["error_message"].startswith("LoRA with name ghost does not exist")
    st, out = gen(srv, [[1, 2, 3]], "ghost")
    assert st == 400 and "not loaded: ghost" in out["error"]["message"]
    st, out = gen(srv, [[1, 2, 3], [4, 5]], ["a1"])
    assert st == 400 and "lora_path" in out["error"]["message"]
    st, out = http(srv, "/load_lora_adapter", {"lora_path": ad["a3"]})
    assert st == 400 and "lora_name" in out["error"]["message"]
    st, out = gen(srv, [[1, 2, 3]], "a1", n_new=3)  # still serving
    assert st == 200 and len(out[0]["output_ids"]) == 3


def test_adapters_load_only_from_allowed_dirs_and_bad_files_are_400(lora_env, tmp_path_factory):
    """A path outside ``--lora-allowed-dirs`` (as given, through ``..`` or a symlink, to the
    directory or to one of its files) is refused with one message that names no path and is
    the same whether the path exists; truncated or garbage weights, garbage config, rank 0 or
    null are 400s; the server keeps serving."""
    srv, ad, d = lora_env["srv"], lora_env["ad"], lora_env["d"]
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(ad["a3"], outside / "a3")
    (d / "via_link").symlink_to(outside / "a3")
    shutil.copytree(ad["a3"], d / "cfg_link")
    (d / "cfg_link" / "adapter_config.json").unlink()
    (d / "cfg_link" / "adapter_config.json").symlink_to(outside / "a3" / "adapter_config.json")
    escapes = [
        str(outside / "a3"),
        str(outside / "missing"),
        "/etc",
        "/nonexistent/x",
        f"{d}/../{outside.name}/a3",
        str(d / "via_link"),
        str(d / "cfg_link"),
    ]
    messages = set()
    for path in escapes:
        st, out = http(srv, "/load_lora_adapter", {"lora_name": "esc", "lora_path": path})
        assert st == 400 and out["success"] is False, (path, out)
        messages.add(out["error_message"])
    assert len(messages) == 1 and "--lora-allowed-dirs" in messages.pop()
    assert not any(str(outside) in json.dumps(v) for v in http(srv, "/get_server_info")[1:])

    def bad(name, edit_cfg=None, weights=None):
        dst = d / name
        shutil.copytree(ad["a3"], dst)
        if edit_cfg is not None:
            (dst / "adapter_config.json").write_text(edit_cfg)
        if weights is not None:
            f = dst / "adapter_model.safetensors"
            f.write_bytes(weights(f.read_bytes()))
        st, out = http(srv, "/load_lora_adapter", {"lora_name": name, "lora_path": str(dst)})
        assert st == 400 and out["success"] is False, (name, st, out)
        return out["error_message"]

    cfg = json.loads((d / "a3" / "adapter_config.json").read_text())
    assert "unreadable" in bad("trunc", weights=lambda b: b[: len(b) // 2])
    assert "unreadable" in bad("garbage", weights=lambda b: b"\x00\xff" * 40)
    assert "not a valid JSON" in bad("badjson", edit_cfg="{not json")
    assert "r=0 must be a positive integer" in bad("r0", json.dumps({**cfg, "r": 0}))
    assert "r=None must be" in bad("rnull", json.dumps({**cfg, "r": None}))
    assert "not a valid JSON" in bad(
        "alpha_nan",
        json.dumps({**cfg, "lora_alpha": 1}).replace('"lora_alpha": 1', '"lora_alpha": NaN'),
    )
    st, out = gen(srv, [[1, 2, 3]], None, n_new=3)  # still serving
    assert st == 200 and len(out[0]["output_ids"]) == 3


def test_prefix_cache_is_kept_per_adapter(lora_env):
    """Keys/values cached under the base model or one adapter never serve another; an
    adapter's own prefix is reused (SGLang keys its radix cache by the adapter's lora_id)."""
    srv, ad, base = lora_env["srv"], lora_env["ad"], lora_env["base"]
    a1 = peft_model(base, ad["a1"])
    prompt = list(range(30, 70))
    for _ in range(2):
        st, base_out = gen(srv, prompt, None, n_new=4)
    assert st == 200 and base_out["meta_info"]["cached_tokens"] > 0  # the cache works
    st, out = gen(srv, prompt, "a1", n_new=6)
    assert st == 200 and out["meta_info"]["cached_tokens"] == 0  # not the base's
    check(a1, prompt, out)
    st, again = gen(srv, prompt, "a1", n_new=6)
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # a1's own
    check(a1, prompt, again)
    assert http(srv, "/load_lora_adapter", {"lora_name": "a1b", "lora_path": ad["a1"]})[0] == 200
    st, other = gen(srv, prompt, "a1b", n_new=6)  # another load
    assert st == 200 and other["meta_info"]["cached_tokens"] == 0
    check(a1, prompt, other)
    assert http(srv, "/unload_lora_adapter", {"lora_name": "a1b"})[0] == 200
    st, scored = gen(srv, prompt, "a1", n_new=6, logprob_start_len=0)
    # input-token logprobs (a forward of their own) are the adapter's too
    got = [x[0] for x in scored["meta_info"]["input_token_logprobs"][1:]]
    ref = teacher_forced_logprobs(a1, prompt, 1)
    assert len(got) == len(ref) and max(abs(a - b) for a, b in zip(ref, got)) <= TOL


def test_swap_under_pause_and_resubmit_with_the_new_adapter(lora_env):
    """A long a1 generation is interrupted by pause; the client loads v2 (a3's weights) and
    unloads a1 on every server, continues, and the resubmitted request runs with v2."""
    srv, ad, base = lora_env["srv"], lora_env["ad"], lora_env["base"]
    prompt = [7, 8, 9, 10]
    box = {}

    def long_request():
        box["first"] = gen(srv, prompt, "a1", n_new=8000)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 60
    while http(srv, "/get_server_info")[1]["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)

    async def swap():
        c = RolloutClient([srv.addr], api_key=API_KEY, timeout_s=60, retries=0)
        try:
            await c.pause()
            await asyncio.get_running_loop().run_in_executor(None, t.join, 60)
            loaded = await c.load_lora_adapter("v2", ad["a3"])
            unloaded = await c.unload_lora_adapter("a1")
            with pytest.raises(
                RolloutRequestError, match="HTTP 400: Failed to load LoRA adapter v2 because it is"
            ):
                await c.load_lora_adapter("v2", ad["a3"])
            await c.resume()
            st, first = box["first"]
            resumed = prompt + first["output_ids"]
            res = await c.generate(resumed, sampling_dict(6, 1.0, ignore_eos=True), lora_path="v2")
            return loaded, unloaded, first, resumed, res
        finally:
            await c.close()

    loaded, unloaded, first, resumed, res = run(swap())
    assert first["meta_info"]["finish_reason"]["type"] == "abort" and first["output_ids"]
    assert loaded[0]["loaded_adapters"] == {"a1": ad["a1"], "a2": ad["a2"], "v2": ad["a3"]}
    assert unloaded[0]["loaded_adapters"] == {"a2": ad["a2"], "v2": ad["a3"]}
    ref = teacher_forced_logprobs(
        peft_model(base, ad["a3"]), resumed + res.output_ids, len(resumed)
    )
    assert max(abs(a - b) for a, b in zip(ref, res.logprobs)) <= TOL
    st, out = gen(srv, [[1, 2]], "a1")
    assert st == 400 and "not loaded: a1" in out["error"]["message"]


def test_max_loaded_loras_evicts_least_recently_used_and_reloads_on_use(lora_env):
    srv, ad, base = lora_env["srv"], lora_env["ad"], lora_env["base"]
    before = http(srv, "/get_server_info")[1]["loaded_adapters"]
    assert len(before) == 2 and "a2" in before  # after the swap test: a2, v2
    gen(srv, [[1, 2]], "a2", n_new=1)  # a2 now most recently used
    st, out = http(srv, "/load_lora_adapter", {"lora_name": "a4", "lora_path": ad["a3"]})
    assert st == 200 and len(out["loaded_adapters"]) == 3
    st, out = http(srv, "/load_lora_adapter", {"lora_name": "a5", "lora_path": ad["a3"]})
    lru = next(n for n in before if n != "a2")
    assert st == 200 and lru not in out["loaded_adapters"] and len(out["loaded_adapters"]) == 3
    st, res = gen(srv, [[5, 6, 7]], lru, n_new=5)  # SGLang reloads an evicted adapter
    assert st == 200
    check(peft_model(base, before[lru]), [5, 6, 7], res[0])


def test_unload_waits_for_the_requests_using_the_adapter(lora_env):
    """As SGLang: the name is unregistered at once (new requests are refused), the answer comes
    once the running request using it has finished (here: aborted)."""
    srv, ad = lora_env["srv"], lora_env["ad"]
    assert http(srv, "/load_lora_adapter", {"lora_name": "w", "lora_path": ad["a3"]})[0] == 200
    order, box = [], {}

    def long_request():
        box["gen"] = gen(srv, [9, 8, 7], "w", n_new=8000, rid="long-w")
        order.append("generate")

    def unload():
        box["unload"] = http(srv, "/unload_lora_adapter", {"lora_name": "w"})
        order.append("unload")

    t1 = threading.Thread(target=long_request)
    t1.start()
    deadline = time.monotonic() + 60
    while http(srv, "/get_server_info")[1]["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t2 = threading.Thread(target=unload)
    t2.start()
    while "w" in http(srv, "/get_server_info")[1]["loaded_adapters"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    st, out = gen(srv, [1, 2], "w")
    assert st == 400 and "not loaded: w" in out["error"]["message"]
    assert order == []  # the unload is still waiting
    assert http(srv, "/abort_request", {"rid": "long-w"})[0] == 200
    t1.join(60)
    t2.join(60)
    assert sorted(order) == ["generate", "unload"]  # the abort released the unload
    assert box["gen"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert box["unload"][0] == 200 and "w" not in box["unload"][1]["loaded_adapters"]


def test_enable_lora_without_paths_needs_rank_and_targets(lora_env, capsys):
    """The flag check runs before the model is loaded: the server exits with the usage error."""
    from areal_mega.inference.server import main

    with pytest.raises(SystemExit) as e:
        main(["--model-path", str(lora_env["base"]), "--port", "1", "--enable-lora"])
    assert e.value.code == 2
    assert "--max-lora-rank and --lora-target-modules" in capsys.readouterr().err


def test_client_generate_sends_lora_path():
    from areal_mega.rollout.generate_result import generate_body

    assert generate_body([1], {}, lora_path="v3")["lora_path"] == "v3"
    assert "lora_path" not in generate_body([1], {})
