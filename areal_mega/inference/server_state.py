"""The state behind the CPU rollout server: the model, its engine, the tokenizer and the
weight-update process groups (the HTTP side is :mod:`areal_mega.inference.server`).

Joining a weight-update group is a blocking rendezvous that may wait up to its ``timeout_s``
(at most :data:`MAX_JOIN_TIMEOUT_S`). Each join runs on its own daemon thread, never on the
event loop's shared executor, so a join that hangs (a trainer that never comes, a closed port)
does not hold up pause / continue / weight loads, and SIGTERM shutdown does not wait for it.
While group ``name`` is joining it is in :attr:`LocalRolloutServer.joining`; requests that need
it are answered 409.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from areal_mega.inference.decoding import BatchedEngine
from areal_mega.inference.hf_corrections import correct_loaded_model
from areal_mega.inference.http_api import BadRequest, Conflict, parse_dtype
from areal_mega.inference.lora_adapters import LoraRegistry, LoraSettings, read_adapter
from areal_mega.inference.lora_layers import LoraLayers
from areal_mega.inference.param_targets import ParamTargets, checkpoint_renames
from areal_mega.inference.prefix_reuse import DEFAULT_PREFIX_CACHE_MB
from areal_mega.inference.vision import DEFAULT_MAX_IMAGES, VisionInputs
from areal_mega.inference.vl_model import is_vision_config, vision_token_ids
from areal_mega.parallel.weight_group import (
    broadcast_from_rank0,
    destroy_update_group,
    init_update_group,
)

# the longest rendezvous /init_weights_update_group may ask for; a longer timeout_s is refused
MAX_JOIN_TIMEOUT_S = 600.0
#: ``--dtype`` (the names of ``model.dtype``): the dtype the model is loaded and generates in
MODEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def attention_implementation(model_path) -> dict:
    """``from_pretrained`` keywords for the attention a model needs: ``eager`` when its config
    soft-caps the attention logits (Gemma 2), which transformers' SDPA path silently drops, or
    has attention sinks (GPT-OSS); transformers' default otherwise (also when the config
    cannot be read here)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    cfg = cfg.get("text_config") or cfg
    if cfg.get("attn_logit_softcapping") is not None or cfg.get("model_type") == "gpt_oss":
        return {"attn_implementation": "eager"}  # GPT-OSS: its sinks (SDPA has none)
    return {}


class LocalRolloutServer:
    """The model, its engine, the tokenizer and the weight-update process groups."""

    def __init__(
        self,
        model_path: str,
        max_running: int = 64,
        api_key: Optional[str] = None,
        max_context: Optional[int] = None,
        enable_return_routed_experts: bool = False,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
        lora: Optional[LoraSettings] = None,
        dtype: str = "fp32",
        max_images: int = DEFAULT_MAX_IMAGES,
    ):
        """``dtype``: a key of :data:`MODEL_DTYPES`, the dtype of the weights and of every
        matmul (the trainer's ``model.dtype``; the sampled tokens' log-probabilities are
        computed in fp32 from the logits either way). ``enable_return_routed_experts``: capture
        MoE routes for requests asking for them (ValueError for a dense model).
        ``prefix_cache_mb``: memory budget of the prefix cache (0: none;
        :mod:`areal_mega.inference.prefix_reuse`). ``lora``: the LoRA flags
        (:mod:`areal_mega.inference.lora_api`); its ``--lora-paths`` are loaded here
        (ValueError naming a bad one). ``max_images``: a VL model's limit of images per
        prompt (more is a 400)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.api_key = api_key
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype {dtype!r}: must be one of {sorted(MODEL_DTYPES)}")
        vision = is_vision_config(AutoConfig.from_pretrained(model_path))
        if vision:  # a VL checkpoint: its image-text-to-text class (vision tower included)
            from transformers import AutoModelForImageTextToText as model_class
        else:
            model_class = AutoModelForCausalLM
        self.model = model_class.from_pretrained(
            model_path, dtype=MODEL_DTYPES[dtype], **attention_implementation(model_path)
        )
        correct_loaded_model(self.model)
        self.model.eval()
        self.dtype_name = str(self.model.dtype).replace("torch.", "")  # e.g. "bfloat16"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except Exception:  # noqa: BLE001 - a model dir without a tokenizer still serves ids
            self.tokenizer = None
        cfg = self.model.config
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        # the images of /generate requests (None: a text-only model refuses image_data)
        self.vision = VisionInputs(model_path, cfg, max_images=max_images) if vision else None
        if vision:
            cfg = cfg.get_text_config()
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(max_context or getattr(cfg, "max_position_embeddings", 4096))
        self.decode = None
        if self.tokenizer is not None:
            self.decode = lambda ids, **kw: self.tokenizer.decode(ids, **kw)
        self.lora_settings = lora or LoraSettings()
        layers = None
        if self.lora_settings.enabled:
            layers = LoraLayers(
                self.model, self.lora_settings.targets, self.lora_settings.max_per_batch
            )
        self.lora_registry = LoraRegistry(
            self.lora_settings, {} if layers is None else layers.modules
        )
        for p in self.lora_settings.preload:
            self.lora_registry.add(
                self.read_lora_adapter(p["lora_name"], p["lora_path"], p["pinned"])
            )
        self.engine = BatchedEngine(
            self.model,
            eos_token_id=eos,
            max_running=max_running,
            decode=self.decode,
            capture_routes=enable_return_routed_experts,
            prefix_cache_mb=prefix_cache_mb,
            lora=layers,
            banned_token_ids=(
                vision_token_ids(self.model.config, self.tokenizer) if vision else ()
            ),
        )
        self.groups: dict = {}  # group name -> process group
        self.joining: set = set()  # group names whose rendezvous is in progress
        self.receiving = 0  # buckets of a distributed weight update being received
        self._groups_lock = threading.Lock()
        self._params = dict(self.model.named_parameters())
        # transformers looks a model's checkpoint renamings up by class name first (Qwen2.5-VL's
        # checkpoint names its text layers model.layers.*, its model model.language_model.*)
        self._renames = checkpoint_renames(type(self.model).__name__) + checkpoint_renames(
            getattr(self.model.config, "model_type", None)
        )
        self._targets = ParamTargets(self.model.state_dict(), self._renames)
        self.started_at = time.time()

    def read_lora_adapter(self, name: str, path: str, pinned: bool = False, confined: bool = False):
        """Read and check one PEFT adapter directory for this model (ValueError).
        ``confined``: a client's path, read only inside ``--lora-allowed-dirs``."""
        return read_adapter(
            name,
            path,
            self.lora_settings,
            self.lora_registry.modules,
            pinned,
            allowed=self.lora_settings.allowed_dirs if confined else None,
        )

    # ---------------------------------------------------------------- weights
    def _assign(self, tensors: dict, version: Optional[str]) -> None:
        """Copy ``tensors`` (HF checkpoint names) into the model and empty the prefix cache
        (keys/values of the old weights are never reused); runs on the engine thread."""
        self.engine.invalidate_prefix_cache()
        targets = ParamTargets(self.model.state_dict(), self._renames)  # its current tensors
        with torch.no_grad():
            for name, t in tensors.items():
                dst = targets.view(name)
                dst.copy_(t.to(dst.dtype))
        if version is not None:
            self.engine.weight_version = str(version)

    def _check_names(self, shapes: dict, full: bool) -> None:
        unknown = sorted(n for n in shapes if self._targets.target(n) is None)
        if unknown:
            raise BadRequest(
                f"unknown parameter name(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
            )
        want = {n: tuple(self._targets.view(n).shape) for n in shapes}
        bad = [
            f"{n}: got {list(s)}, expected {list(want[n])}"
            for n, s in shapes.items()
            if tuple(s) != want[n]
        ]
        if bad:
            raise BadRequest("shape mismatch: " + "; ".join(bad[:5]))
        if full:
            missing = self._targets.missing(shapes, self._params)
            if missing:
                raise BadRequest(f"checkpoint is missing parameter(s) {missing[:5]}")

    def load_from_disk(self, path: str, version: Optional[str]) -> None:
        """Load every ``*.safetensors`` file under ``path`` (strict names and shapes)."""
        from safetensors.torch import load_file

        if not os.path.isdir(path):
            raise BadRequest(f"model_path {path!r}: not a directory")
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise BadRequest(f"model_path {path!r}: no *.safetensors files")
        tensors: dict = {}
        for f in files:
            tensors.update(load_file(f))
        self._check_names({k: v.shape for k, v in tensors.items()}, full=True)
        self.engine.run_exclusive(lambda: self._assign(tensors, version))
        self.model_path = path

    def start_join(
        self, addr: str, port: int, rank: int, world: int, name: str, backend: str, timeout_s: float
    ) -> concurrent.futures.Future:
        """Start joining the trainer's weight-update group ``name`` on a thread of its own;
        the returned future completes when the rendezvous succeeds or fails (at the latest
        after ``timeout_s``). Raises :class:`Conflict` if ``name`` exists or is joining."""
        if not 0 < timeout_s <= MAX_JOIN_TIMEOUT_S:
            raise BadRequest(
                f"init_weights_update_group.timeout_s={timeout_s}: must be in "
                f"(0, {MAX_JOIN_TIMEOUT_S:g}]"
            )
        with self._groups_lock:
            if name in self.groups:
                raise BadRequest(
                    f"init_weights_update_group.group_name={name!r}: already initialised"
                )
            if name in self.joining:
                raise Conflict(f"init_weights_update_group.group_name={name!r}: still joining")
            self.joining.add(name)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()

        def join():
            try:
                pg = init_update_group(addr, port, world, rank, name, backend, timeout_s)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting request
                with self._groups_lock:
                    self.joining.discard(name)
                fut.set_exception(e)
                return
            with self._groups_lock:
                self.groups[name] = pg
                self.joining.discard(name)
            fut.set_result(pg)

        threading.Thread(target=join, name=f"join-{name}", daemon=True).start()
        return fut

    def group(self, name: str, where: str):
        """The joined group ``name``: 409 while it is joining, 400 if it does not exist."""
        with self._groups_lock:
            if name in self.joining:
                raise Conflict(
                    f"{where}.group_name={name!r}: still joining (wait for "
                    "/init_weights_update_group to answer)"
                )
            if name not in self.groups:
                raise BadRequest(
                    f"{where}.group_name={name!r}: not initialised "
                    "(call /init_weights_update_group first)"
                )
            return self.groups[name]

    def destroy_group(self, name: str) -> None:
        """Leave and destroy weight-update group ``name``."""
        self.group(name, "destroy_weights_update_group")
        with self._groups_lock:
            pg = self.groups.pop(name)
        destroy_update_group(pg)

    def receive_distributed(
        self, name: str, names, dtypes, shapes, version, load: bool = True
    ) -> None:
        """Receive one bucket (one broadcast per tensor, root 0) and load it (unless
        ``load`` is False: the tensors are received and dropped)."""
        pg = self.group(name, "update_weights_from_distributed")
        tensors = {}
        self.receiving += 1
        try:
            for n, dt, shp in zip(names, dtypes, shapes):
                t = torch.empty(tuple(shp), dtype=parse_dtype(dt))
                broadcast_from_rank0(pg, t)
                tensors[n] = t
        finally:
            self.receiving -= 1
        if load:
            self._assign(tensors, version)
