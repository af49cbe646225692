"""CPU rollout server speaking SGLang's native HTTP API on a real HF causal LM.

    python -m areal_mega.rollout.local_server --model-path DIR --port P [--api-key KEY]

Endpoints (same paths and JSON fields as SGLang, see ``shared/design.md``):
``POST /generate``, ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``, ``/flush_cache``;
``GET /health``, ``/health_generate``, ``/get_model_info``, ``/get_server_info``.

Bad input (malformed JSON, unknown fields, wrong types, over-long requests) is answered with
HTTP 400 and ``{"error": {"message": ...}}``; the server keeps serving. With ``--api-key`` every
request needs ``Authorization: Bearer KEY`` (401 otherwise), like SGLang's ``--api-key``.
Generation is batched per decode step by :class:`~areal_mega.rollout.engine.BatchedEngine`;
see there for what the returned logprobs mean.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import glob
import json
import logging
import os
import time
import uuid
from typing import Any, Optional

import torch
from aiohttp import web

from areal_mega.rollout.engine import BatchedEngine, GenRequest, SamplingParams

log = logging.getLogger("areal_mega.rollout.local_server")

GENERATE_FIELDS = {"input_ids", "text", "sampling_params", "return_logprob", "stream", "rid",
                   "logprob_start_len", "return_text_in_logprobs", "top_logprobs_num"}
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                   "ignore_eos", "sampling_seed", "skip_special_tokens", "no_stop_trim", "min_p",
                   "stop"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


class BadRequest(ValueError):
    """Raised on invalid input; answered with HTTP 400 and the message."""


def _err(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _check_fields(body: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _get(body: dict, key: str, tp, default=None, where: str = "request", required=False):
    if key not in body or body[key] is None:
        if required:
            raise BadRequest(f"{where}.{key}: required")
        return default
    v = body[key]
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if tp is int and isinstance(v, bool) or not isinstance(v, tp):
        raise BadRequest(f"{where}.{key}={v!r}: expected {getattr(tp, '__name__', tp)}")
    return v


def _parse_dtype(name: str) -> torch.dtype:
    key = str(name).replace("torch.", "")
    if key not in DTYPES:
        raise BadRequest(f"dtype {name!r}: must be one of {sorted(DTYPES)}")
    return DTYPES[key]


class LocalRolloutServer:
    """The model, its engine, the tokenizer and the weight-update process groups."""

    def __init__(self, model_path: str, max_running: int = 64, api_key: Optional[str] = None,
                 max_context: Optional[int] = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.api_key = api_key
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except Exception:  # noqa: BLE001 - a model dir without a tokenizer still serves ids
            self.tokenizer = None
        cfg = self.model.config
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(max_context or getattr(cfg, "max_position_embeddings", 4096))
        self.engine = BatchedEngine(self.model, eos_token_id=eos, max_running=max_running)
        self.groups: dict[str, Any] = {}
        self._params = dict(self.model.named_parameters())
        self._all_keys = set(self.model.state_dict().keys())
        self.started_at = time.time()

    # ---------------------------------------------------------------- weights
    def _assign(self, tensors: dict, version: Optional[str]) -> None:
        """Copy ``tensors`` (HF names) into the model; runs on the engine thread."""
        sd = self.model.state_dict()
        with torch.no_grad():
            for name, t in tensors.items():
                sd[name].copy_(t.to(sd[name].dtype))
        if version is not None:
            self.engine.weight_version = str(version)

    def _check_names(self, shapes: dict, full: bool) -> None:
        sd = self.model.state_dict()
        unknown = sorted(n for n in shapes if n not in self._all_keys)
        if unknown:
            raise BadRequest(f"unknown parameter name(s) {unknown[:5]}"
                             f"{' ...' if len(unknown) > 5 else ''}")
        bad = [f"{n}: got {list(s)}, expected {list(sd[n].shape)}"
               for n, s in shapes.items() if tuple(s) != tuple(sd[n].shape)]
        if bad:
            raise BadRequest("shape mismatch: " + "; ".join(bad[:5]))
        if full:
            missing = sorted(n for n in self._params if n not in shapes)
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

    def init_group(self, addr: str, port: int, rank: int, world: int, name: str,
                   backend: str, timeout_s: float) -> None:
        """Join the trainer's weight-update group (blocking rendezvous; call off the loop)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, world, False, timeout=timeout)
        prefixed = dist.PrefixStore(name, store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        else:
            pg = dist.ProcessGroupNCCL(prefixed, rank, world)
        self.groups[name] = (pg, store)

    def receive_distributed(self, name: str, names, dtypes, shapes, version,
                            load: bool = True) -> None:
        """Receive one bucket (one broadcast per tensor, root 0) and load it (unless
        ``load`` is False: the tensors are received and dropped)."""
        import torch.distributed as dist

        pg, _ = self.groups[name]
        tensors = {}
        for n, dt, shp in zip(names, dtypes, shapes):
            t = torch.empty(tuple(shp), dtype=_parse_dtype(dt))
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([t], opts).wait()
            tensors[n] = t
        if load:
            self._assign(tensors, version)


# ------------------------------------------------------------------------- HTTP handlers


def build_app(srv: LocalRolloutServer) -> web.Application:
    """The aiohttp application serving ``srv``."""

    @web.middleware
    async def guard(request: web.Request, handler):
        if srv.api_key:
            if request.headers.get("Authorization", "") != f"Bearer {srv.api_key}":
                return _err(401, "missing or wrong API key (Authorization: Bearer ...)")
        try:
            return await handler(request)
        except BadRequest as e:
            return _err(400, str(e))
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - answer, log, keep serving
            log.exception("handler failed")
            return _err(500, f"{type(e).__name__}: {e}")

    async def body_of(request: web.Request, allow_empty=False) -> dict:
        raw = await request.read()
        if not raw.strip():
            if allow_empty:
                return {}
            raise BadRequest("empty body: expected a JSON object")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest(f"expected a JSON object, got {type(body).__name__}")
        return body

    def parse_generate(body: dict) -> tuple[list, SamplingParams, str]:
        _check_fields(body, GENERATE_FIELDS, "generate")
        if body.get("stream"):
            raise BadRequest("generate.stream=true: streaming is not supported by this server")
        ids = body.get("input_ids")
        if ids is None:
            text = _get(body, "text", str, where="generate")
            if text is None:
                raise BadRequest("generate: one of input_ids or text is required")
            if srv.tokenizer is None:
                raise BadRequest("generate.text: this model has no tokenizer; send input_ids")
            ids = srv.tokenizer(text, add_special_tokens=False)["input_ids"]
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise BadRequest("generate.input_ids: expected a non-empty list of ints")
        if min(ids) < 0 or max(ids) >= srv.vocab_size:
            raise BadRequest(f"generate.input_ids: token ids must be in [0, {srv.vocab_size})")
        sp = _get(body, "sampling_params", dict, {}, "generate")
        _check_fields(sp, SAMPLING_FIELDS, "sampling_params")
        w = "sampling_params"
        if sp.get("stop"):
            raise BadRequest("sampling_params.stop (strings) is not supported; "
                             "use stop_token_ids")
        p = SamplingParams(
            max_new_tokens=_get(sp, "max_new_tokens", int, 128, w),
            temperature=_get(sp, "temperature", float, 1.0, w),
            top_p=_get(sp, "top_p", float, 1.0, w),
            top_k=_get(sp, "top_k", int, -1, w),
            stop_token_ids=tuple(_get(sp, "stop_token_ids", list, [], w)),
            ignore_eos=_get(sp, "ignore_eos", bool, False, w),
            sampling_seed=_get(sp, "sampling_seed", int, None, w),
        )
        if p.max_new_tokens < 0:
            raise BadRequest("sampling_params.max_new_tokens: must be >= 0")
        if p.temperature < 0:
            raise BadRequest("sampling_params.temperature: must be >= 0")
        if not 0 < p.top_p <= 1:
            raise BadRequest("sampling_params.top_p: must be in (0, 1]")
        if p.top_k == 0 or p.top_k < -1:
            raise BadRequest("sampling_params.top_k: must be -1 (off) or >= 1")
        if not all(isinstance(t, int) for t in p.stop_token_ids):
            raise BadRequest("sampling_params.stop_token_ids: expected a list of ints")
        if len(ids) + p.max_new_tokens > srv.max_context:
            raise BadRequest(f"request too long: {len(ids)} prompt tokens + max_new_tokens "
                             f"{p.max_new_tokens} > context length {srv.max_context}")
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise BadRequest("generate.rid: expected a string")
        return ids, p, rid

    async def generate(request: web.Request):
        body = await body_of(request)
        ids, params, rid = parse_generate(body)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def on_done(r: GenRequest):
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r))

        gen = None
        if params.sampling_seed is not None:
            gen = torch.Generator().manual_seed(params.sampling_seed)
        req = GenRequest(rid=rid, input_ids=ids, params=params, on_done=on_done, generator=gen)
        srv.engine.submit(req)
        try:
            r = await fut
        except asyncio.CancelledError:  # client went away: free the slot
            srv.engine.abort(rid, "client disconnected")
            raise
        meta = {
            "id": rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(ids),
            "completion_tokens": len(r.output_ids),
            "weight_version": r.weight_version,
            "e2e_latency": time.time() - r.created_at,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                             zip(r.logprobs, r.output_ids)]
        text = srv.tokenizer.decode(r.output_ids) if srv.tokenizer is not None else ""
        return web.json_response({"text": text, "output_ids": r.output_ids, "meta_info": meta})

    async def abort_request(request: web.Request):
        body = await body_of(request)
        _check_fields(body, {"rid", "abort_all"}, "abort_request")
        if body.get("abort_all"):
            n = srv.engine.abort(None)
        else:
            n = srv.engine.abort(_get(body, "rid", str, where="abort_request", required=True))
        return web.json_response({"success": True, "num_aborted": n})

    async def pause_generation(request: web.Request):
        body = await body_of(request, allow_empty=True)
        _check_fields(body, {"mode"}, "pause_generation")
        if body.get("mode", "abort") != "abort":
            raise BadRequest("pause_generation.mode: only 'abort' is supported")
        srv.engine.pause()
        # wait until the aborted requests have left the batch, so the caller may update weights
        await asyncio.get_running_loop().run_in_executor(None, srv.engine.run_exclusive,
                                                         lambda: None)
        return web.json_response({"success": True})

    async def continue_generation(request: web.Request):
        await body_of(request, allow_empty=True)
        srv.engine.resume()
        return web.json_response({"success": True})

    async def update_weights_from_disk(request: web.Request):
        body = await body_of(request)
        _check_fields(body, {"model_path", "abort_all_requests", "weight_version", "load_format"},
                      "update_weights_from_disk")
        path = _get(body, "model_path", str, where="update_weights_from_disk", required=True)
        version = body.get("weight_version")
        if body.get("abort_all_requests"):
            srv.engine.abort(None, "aborted for weight update")
        await asyncio.get_running_loop().run_in_executor(
            None, srv.load_from_disk, path, None if version is None else str(version))
        return web.json_response({"success": True, "message": f"loaded {path}",
                                  "weight_version": srv.engine.weight_version})

    async def init_weights_update_group(request: web.Request):
        body = await body_of(request)
        w = "init_weights_update_group"
        _check_fields(body, {"master_address", "master_port", "rank_offset", "world_size",
                             "group_name", "backend", "timeout_s"}, w)
        addr = _get(body, "master_address", str, where=w, required=True)
        port = _get(body, "master_port", int, where=w, required=True)
        rank = _get(body, "rank_offset", int, where=w, required=True)
        world = _get(body, "world_size", int, where=w, required=True)
        name = _get(body, "group_name", str, "weight_update_group", w)
        backend = _get(body, "backend", str, "nccl", w)
        timeout_s = _get(body, "timeout_s", float, 300.0, w)
        if backend not in ("gloo", "nccl"):
            raise BadRequest(f"{w}.backend={backend!r}: must be gloo or nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest(f"{w}.backend='nccl': no CUDA on this server; use gloo")
        if not 1 <= rank < world:
            raise BadRequest(f"{w}.rank_offset={rank}: must be in [1, world_size)")
        if name in srv.groups:
            raise BadRequest(f"{w}.group_name={name!r}: already initialised")
        await asyncio.get_running_loop().run_in_executor(
            None, srv.init_group, addr, port, rank, world, name, backend, timeout_s)
        return web.json_response({"success": True, "message": f"joined {name} as rank {rank}"})

    async def update_weights_from_distributed(request: web.Request):
        body = await body_of(request)
        w = "update_weights_from_distributed"
        _check_fields(body, {"names", "dtypes", "shapes", "group_name", "weight_version",
                             "flush_cache"}, w)
        names = _get(body, "names", list, where=w, required=True)
        dtypes = _get(body, "dtypes", list, where=w, required=True)
        shapes = _get(body, "shapes", list, where=w, required=True)
        name = _get(body, "group_name", str, "weight_update_group", w)
        version = body.get("weight_version")
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"{w}: names, dtypes and shapes must have equal lengths")
        if name not in srv.groups:
            raise BadRequest(f"{w}.group_name={name!r}: not initialised "
                             "(call /init_weights_update_group first)")
        for dt in dtypes:
            _parse_dtype(dt)
        if not all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s)
                   for s in shapes):
            raise BadRequest(f"{w}.shapes: expected lists of non-negative ints")
        # names/shapes are checked after receiving, so that a bad request still takes part in
        # the trainer's broadcasts and the group stays usable
        try:
            srv._check_names(dict(zip(names, shapes)), full=False)
            problem = None
        except BadRequest as e:
            problem = e
        await asyncio.get_running_loop().run_in_executor(
            None, srv.engine.run_exclusive,
            lambda: srv.receive_distributed(name, names, dtypes, shapes,
                                            None if version is None else str(version),
                                            load=problem is None))
        if problem is not None:
            raise problem
        return web.json_response({"success": True, "message": f"updated {len(names)} tensors"})

    async def destroy_weights_update_group(request: web.Request):
        body = await body_of(request)
        _check_fields(body, {"group_name"}, "destroy_weights_update_group")
        name = _get(body, "group_name", str, "weight_update_group", "destroy_weights_update_group")
        if srv.groups.pop(name, None) is None:
            raise BadRequest(f"group_name={name!r}: not initialised")
        return web.json_response({"success": True})

    async def update_weight_version(request: web.Request):
        body = await body_of(request)
        _check_fields(body, {"new_version", "abort_all_requests"}, "update_weight_version")
        v = body.get("new_version")
        if v is None or isinstance(v, (dict, list, bool)):
            raise BadRequest("update_weight_version.new_version: required (string or int)")
        await asyncio.get_running_loop().run_in_executor(
            None, srv.engine.run_exclusive,
            lambda: setattr(srv.engine, "weight_version", str(v)))
        return web.json_response({"success": True, "weight_version": str(v)})

    async def flush_cache(request: web.Request):
        # no prefix cache is kept between requests; accept for API compatibility
        return web.json_response({"success": True})

    async def health(request: web.Request):
        if not srv.engine.alive():
            return _err(503, "engine thread is dead")
        return web.json_response({"status": "ok"})

    async def get_model_info(request: web.Request):
        return web.json_response({
            "model_path": srv.model_path, "tokenizer_path": srv.model_path,
            "is_generation": True, "weight_version": srv.engine.weight_version,
            "vocab_size": srv.vocab_size, "max_context": srv.max_context})

    async def get_server_info(request: web.Request):
        e = srv.engine
        return web.json_response({
            "num_running": e.num_running, "num_waiting": e.num_waiting, "paused": e.paused,
            "decode_steps": e.steps, "tokens_generated": e.tokens_generated,
            "weight_version": e.weight_version, "uptime_s": time.time() - srv.started_at})

    app = web.Application(middlewares=[guard], client_max_size=64 << 20)
    post = {"/generate": generate, "/abort_request": abort_request,
            "/pause_generation": pause_generation, "/continue_generation": continue_generation,
            "/update_weights_from_disk": update_weights_from_disk,
            "/init_weights_update_group": init_weights_update_group,
            "/update_weights_from_distributed": update_weights_from_distributed,
            "/destroy_weights_update_group": destroy_weights_update_group,
            "/update_weight_version": update_weight_version, "/flush_cache": flush_cache}
    for path, h in post.items():
        app.router.add_post(path, h)
    for path, h in {"/health": health, "/health_generate": health,
                    "/get_model_info": get_model_info, "/get_server_info": get_server_info}.items():
        app.router.add_get(path, h)
    app.on_shutdown.append(lambda _app: asyncio.get_running_loop().run_in_executor(
        None, srv.engine.shutdown))
    return app


def main(argv: Optional[list] = None) -> None:
    """CLI entry point: load the model and serve until killed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key", default=os.environ.get("AREAL_ROLLOUT_API_KEY"))
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.num_threads)
    srv = LocalRolloutServer(args.model_path, max_running=args.max_running_requests,
                             api_key=args.api_key, max_context=args.max_context)
    print(f"local rollout server: {args.model_path} on http://{args.host}:{args.port}",
          flush=True)
    web.run_app(build_app(srv), host=args.host, port=args.port, print=None,
                handle_signals=True, access_log=None)


if __name__ == "__main__":
    main()
