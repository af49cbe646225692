"""CPU rollout server speaking SGLang's native HTTP API on a real HF causal LM.

    python -m areal_mega.inference.server --model-path DIR --port P [--api-key KEY]

Endpoints (same paths and JSON fields as SGLang):
``POST /generate``, ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
``/update_weight_version``, ``/flush_cache``, ``/load_lora_adapter``,
``/unload_lora_adapter``; ``GET /health``, ``/health_generate``, ``/get_model_info`` (alias
``/model_info``), ``/get_server_info`` (alias ``/server_info``).
LoRA (SGLang's ``--enable-lora``, ``--lora-paths``, ``--max-lora-rank``,
``--lora-target-modules``, ``--max-loras-per-batch``, ``--max-loaded-loras``): adapters are
loaded and unloaded by name, and ``/generate``'s ``lora_path`` picks one per prompt; a decode
batch mixes rows of several adapters and of the base model (:mod:`areal_mega.inference.lora_api`).
``--enable-return-routed-experts`` (MoE models): ``/generate`` with ``return_routed_experts``
answers the tokens' routed experts as SGLang does (:mod:`areal_mega.inference.route_capture`).
A vision-language checkpoint (Qwen2.5-VL) is served with SGLang's ``image_data`` on
``/generate`` (processor-expanded ``input_ids``; images checked against the placeholders,
vision tokens never sampled; :mod:`areal_mega.inference.vision`).
``--prefix-cache-mb`` (default 512, 0: off): prompt prefixes already forwarded are served from
a radix cache, ``meta_info.cached_tokens`` counting them as SGLang does; ``/flush_cache``
empties it when idle, a weight update always (:mod:`areal_mega.inference.prefix_reuse`).

As on SGLang, request bodies are parsed leniently: keys an endpoint does not know are ignored
(except inside ``sampling_params``, see :mod:`areal_mega.inference.http_api`). Bad input
(malformed JSON, wrong types, out-of-range values, over-long requests) is answered with HTTP 400
and ``{"error": {"message": ...}}`` naming the key; the server keeps serving. With
``--api-key`` every request except ``/health*`` needs ``Authorization: Bearer KEY`` (401
otherwise), like SGLang's ``--api-key``. ``--host`` other than loopback needs a key (or the
logged opt-out ``--allow-unauthenticated``): the server refuses to start. Generation is
batched per decode step by
:class:`~areal_mega.inference.decoding.BatchedEngine`; sampling and logprobs are described in
:mod:`areal_mega.inference.sampling`. The weight-update group is created the SGLang way
(:mod:`areal_mega.parallel.weight_group`); the model side lives in
:mod:`areal_mega.inference.server_state`.

One client must not hurt the others:
- a client that disconnects cancels its handler (aiohttp ``handler_cancellation``), which
  aborts its requests in the engine: their slots are free at the next decode step;
- ``--idle-timeout S`` (default 30): a connection that has not sent complete request headers S
  seconds after it opened or after its previous answer is closed (aiohttp's keep-alive timer,
  which aiohttp 3.14 also arms when a connection opens), and a request body not received
  within S seconds of the headers is answered 408 and the connection closed;
- a body nested too deeply for the JSON parser is a 400, like any malformed body;
- a row that cannot be sampled fails alone (see :mod:`areal_mega.inference.decoding`);
- weight-group joins run on threads of their own with a bounded ``timeout_s``
  (:mod:`areal_mega.inference.server_state`), so pause / continue / weight loads / SIGTERM
  answer while a join is pending.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import time
from typing import Optional

import torch
from aiohttp import web

from areal_mega.common.http_guard import run_app_guarded
from areal_mega.inference.decoding import GenRequest
from areal_mega.inference.http_api import (
    DISK_LOAD_FORMATS,
    DIST_LOAD_FORMATS,
    MAX_BODY,
    BadRequest,
    RequestTimeout,
    TooLarge,
    error_response,
    get_field,
    get_int_like,
    ignore_unknown,
    load_format_of,
    parse_dtype,
    parse_generate,
    parse_logprob_starts,
    parse_routes_start,
    response_of,
    version_of,
)
from areal_mega.inference.input_logprobs import input_token_logprobs, needs_forward
from areal_mega.inference.lora_api import (
    add_lora_flags,
    add_lora_routes,
    lora_server_info,
    lora_settings_of,
    release_adapters,
    resolve_adapters,
)
from areal_mega.inference.prefix_reuse import DEFAULT_PREFIX_CACHE_MB
from areal_mega.inference.server_state import (
    MAX_JOIN_TIMEOUT_S,
    MODEL_DTYPES,
    LocalRolloutServer,
)
from areal_mega.inference.vision import DEFAULT_MAX_IMAGES, parse_image_data
from areal_mega.security import API_KEY_ENV, ConfigError, check_bind

__all__ = ["LocalRolloutServer", "MAX_JOIN_TIMEOUT_S", "build_app", "main"]

DEFAULT_IDLE_TIMEOUT_S = 30.0
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there "
    "are running or waiting requests, the operation will not be performed.)\n"
)

log = logging.getLogger("areal_mega.inference.server")


# ------------------------------------------------------------------------- HTTP handlers


def build_app(
    srv: LocalRolloutServer, body_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
) -> web.Application:
    """The aiohttp application serving ``srv``; a request body must arrive within
    ``body_timeout_s`` of its headers (408 otherwise). Serve it with
    ``handler_cancellation=True`` so that a client that goes away frees its slots."""

    @web.middleware
    async def guard(request: web.Request, handler):
        # like SGLang's API-key middleware, health probes need no key
        if srv.api_key and not request.path.startswith("/health"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {srv.api_key}".encode()):
                return error_response(401, "missing or wrong API key (Authorization: Bearer ...)")
        try:
            return await handler(request)
        except BadRequest as e:
            resp = error_response(e.status, str(e))
            if isinstance(e, (RequestTimeout, TooLarge)):
                resp.force_close()  # the rest of the body may still come: drop the connection
            return resp
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - answer, log, keep serving
            log.exception("handler failed")
            return error_response(500, f"{type(e).__name__}: {e}")

    async def body_of(request: web.Request, allow_empty=False) -> dict:
        try:
            raw = await asyncio.wait_for(request.read(), body_timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"request body not received within {body_timeout_s:g} s (--idle-timeout)"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise TooLarge(f"request body larger than {MAX_BODY >> 20} MiB") from None
        if not raw.strip():
            if allow_empty:
                return {}
            raise BadRequest("empty body: expected a JSON object")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON: {e}") from None
        except RecursionError:
            raise BadRequest("malformed JSON: nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest(f"expected a JSON object, got {type(body).__name__}")
        return body

    def run_blocking(fn, *args):
        return asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def generate(request: web.Request):
        body = await body_of(request)
        prompts, params, n, rids, as_list = parse_generate(
            body, srv.tokenizer, srv.vocab_size, srv.max_context
        )
        starts = parse_logprob_starts(body, prompts)
        # SGLang ignores the flag on a server started without --enable-return-routed-experts
        routes = (
            get_field(body, "return_routed_experts", bool, False, "generate")
            and srv.engine.routes is not None
        )
        routes_start = parse_routes_start(body, prompts) if routes else 0
        images = await images_of(body, prompts)
        adapters = await resolve_adapters(srv, body, len(prompts))
        try:
            return await generate_with(
                body,
                prompts,
                params,
                n,
                rids,
                as_list,
                starts,
                routes,
                routes_start,
                adapters,
                images,
            )
        finally:
            await release_adapters(srv, adapters)

    async def images_of(body: dict, prompts: list) -> list:
        """Each prompt's decoded and checked images (None: none), see
        :mod:`areal_mega.inference.vision`; 400 naming the problem."""
        src = body.get("input_ids")
        batched = isinstance(src if src is not None else body.get("text"), list) and (
            src is None or isinstance(src[0], list)
        )
        items = parse_image_data(body, prompts, batched)
        if srv.vision is None:
            if items is not None and any(items):
                raise BadRequest("generate.image_data: this model has no vision encoder")
            return [None] * len(prompts)
        items = items or [None] * len(prompts)
        where = ["generate.image_data" + (f"[{i}]" if batched else "") for i in range(len(items))]
        return await run_blocking(
            lambda: [srv.vision.encode(p, it, w) for p, it, w in zip(prompts, items, where)]
        )

    async def generate_with(
        body, prompts, params, n, rids, as_list, starts, routes, routes_start, adapters, images
    ):
        version, values = None, [[None]] * len(prompts)
        if starts is not None and any(needs_forward(k, len(p)) for k, p in zip(starts, prompts)):
            # SGLang's input_token_logprobs: one forward per prompt length, between decode steps

            def score():
                return (
                    input_token_logprobs(
                        srv.engine.model, prompts, starts, adapters, srv.engine.lora, images
                    ),
                    srv.engine.weight_version,
                )

            values, version = await run_blocking(srv.engine.run_exclusive, score)
        loop = asyncio.get_running_loop()
        reqs, futs = [], []
        for i, rid in enumerate(rids):
            fut = loop.create_future()

            def on_done(r: GenRequest, fut=fut):
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r))

            gen = None
            if params.sampling_seed is not None:
                gen = torch.Generator().manual_seed(params.sampling_seed)
            reqs.append(
                GenRequest(
                    rid=rid,
                    input_ids=list(prompts[i // n]),
                    params=params,
                    on_done=on_done,
                    generator=gen,
                    return_routed_experts=routes,
                    routes_start=routes_start,
                    lora=adapters[i // n],
                    images=images[i // n],
                    # SGLang: with return_logprob no prefix past its start
                    prefix_limit=None if starts is None else starts[i // n],
                )
            )
            if version is not None:  # what a prefill-only request reports
                reqs[-1].weight_version = version
            futs.append(fut)
        for r in reqs:
            srv.engine.submit(r)
        try:
            done = await asyncio.gather(*futs)
        except asyncio.CancelledError:  # client went away: free the slots
            for r in reqs:
                srv.engine.abort(r.rid, "client disconnected")
            raise
        now = time.time()
        out = [
            response_of(
                r,
                len(r.input_ids),
                params,
                bool(body.get("return_logprob")),
                bool(body.get("return_text_in_logprobs")),
                srv.decode,
                now,
                None if starts is None else (values[i // n], r.input_ids[starts[i // n] :]),
            )
            for i, r in enumerate(done)
        ]
        return web.json_response(out if as_list else out[0])

    async def abort_request(request: web.Request):
        body = await body_of(request)
        ignore_unknown(
            body, {"rid", "abort_all", "finished_reason", "abort_message"}, "abort_request"
        )
        if body.get("abort_all") or not body.get("rid"):
            # SGLang: an empty rid with abort_all aborts everything
            if not body.get("abort_all"):
                raise BadRequest("abort_request: give rid or abort_all=true")
            n = srv.engine.abort(None)
        else:
            n = srv.engine.abort(get_field(body, "rid", str, where="abort_request"))
        return web.json_response({"success": True, "num_aborted": n})

    async def pause_generation(request: web.Request):
        body = await body_of(request, allow_empty=True)
        ignore_unknown(body, {"mode"}, "pause_generation")
        if body.get("mode", "abort") != "abort":
            raise BadRequest("pause_generation.mode: only 'abort' is supported")
        srv.engine.pause()
        # wait until the aborted requests have left the batch, so the caller may update weights
        await run_blocking(srv.engine.run_exclusive, lambda: None)
        return web.json_response({"success": True})

    async def continue_generation(request: web.Request):
        await body_of(request, allow_empty=True)
        srv.engine.resume()
        return web.json_response({"success": True})

    async def update_weights_from_disk(request: web.Request):
        body = await body_of(request)
        w = "update_weights_from_disk"
        ignore_unknown(
            body,
            {"model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache"},
            w,
        )
        path = get_field(body, "model_path", str, where=w, required=True)
        version = version_of(body, w)
        load_format_of(body, w, DISK_LOAD_FORMATS)
        if get_field(body, "abort_all_requests", bool, False, w):
            srv.engine.abort(None, "aborted for weight update")
        await run_blocking(srv.load_from_disk, path, version)
        return web.json_response(
            {
                "success": True,
                "message": f"loaded {path}",
                "num_paused_requests": 0,
                "weight_version": srv.engine.weight_version,
            }
        )

    async def init_weights_update_group(request: web.Request):
        body = await body_of(request)
        w = "init_weights_update_group"
        ignore_unknown(
            body,
            {
                "master_address",
                "master_port",
                "rank_offset",
                "world_size",
                "group_name",
                "backend",
                "timeout_s",
            },
            w,
        )
        addr = get_field(body, "master_address", str, where=w, required=True)
        port = get_int_like(body, "master_port", w)
        rank = get_int_like(body, "rank_offset", w)
        world = get_int_like(body, "world_size", w)
        name = get_field(body, "group_name", str, "weight_update_group", w)
        backend = get_field(body, "backend", str, "nccl", w)
        timeout_s = get_field(body, "timeout_s", float, 300.0, w)  # capped by start_join
        if not 0 < port < 65536:
            raise BadRequest(f"{w}.master_port={port}: must be a TCP port")
        if backend not in ("gloo", "nccl"):
            raise BadRequest(f"{w}.backend={backend!r}: must be gloo or nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest(f"{w}.backend='nccl': no CUDA on this server; use gloo")
        if not 1 <= rank < world:
            raise BadRequest(f"{w}.rank_offset={rank}: must be in [1, world_size)")
        if not name:
            raise BadRequest(f"{w}.group_name: must not be empty")
        # the join runs on its own thread (see server_state); if this client goes away the
        # join still completes or times out, and the group is kept if it was made
        joined = asyncio.wrap_future(
            srv.start_join(addr, port, rank, world, name, backend, timeout_s)
        )
        stop_wait = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait([joined, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
        if not joined.done():  # shutting down: answer now, leave the join to its thread
            return error_response(503, f"{w}: server shutting down while joining {name!r}")
        try:
            joined.result()
        except Exception as e:  # noqa: BLE001 - SGLang answers a failed join with 400
            raise BadRequest(
                f"{w}: joining {name!r} at {addr}:{port} failed: {type(e).__name__}: {e}"
            ) from None
        return web.json_response({"success": True, "message": f"joined {name} as rank {rank}"})

    async def update_weights_from_distributed(request: web.Request):
        body = await body_of(request)
        w = "update_weights_from_distributed"
        ignore_unknown(
            body,
            {
                "names",
                "dtypes",
                "shapes",
                "group_name",
                "flush_cache",
                "abort_all_requests",
                "weight_version",
                "load_format",
            },
            w,
        )
        names = get_field(body, "names", list, where=w, required=True)
        dtypes = get_field(body, "dtypes", list, where=w, required=True)
        shapes = get_field(body, "shapes", list, where=w, required=True)
        name = get_field(body, "group_name", str, "weight_update_group", w)
        version = version_of(body, w)
        abort_all = get_field(body, "abort_all_requests", bool, False, w)
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"{w}: names, dtypes and shapes must have equal lengths")
        srv.group(name, w)  # 409 while joining, 400 if unknown
        load_format_of(body, w, DIST_LOAD_FORMATS)
        for dt in dtypes:
            parse_dtype(dt)
        if not all(
            isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes
        ):
            raise BadRequest(f"{w}.shapes: expected lists of non-negative ints")
        if abort_all:
            srv.engine.abort(None, "aborted for weight update")
        # names/shapes are checked after receiving, so that a bad request still takes part in
        # the trainer's broadcasts and the group stays usable
        try:
            srv._check_names(dict(zip(names, shapes)), full=False)
            problem = None
        except BadRequest as e:
            problem = e
        await run_blocking(
            srv.engine.run_exclusive,
            lambda: srv.receive_distributed(
                name, names, dtypes, shapes, version, load=problem is None
            ),
        )
        if problem is not None:
            raise problem
        return web.json_response({"success": True, "message": f"updated {len(names)} tensors"})

    async def destroy_weights_update_group(request: web.Request):
        body = await body_of(request, allow_empty=True)
        ignore_unknown(body, {"group_name"}, "destroy_weights_update_group")
        name = get_field(
            body, "group_name", str, "weight_update_group", "destroy_weights_update_group"
        )
        await run_blocking(srv.destroy_group, name)
        return web.json_response({"success": True})

    async def update_weight_version(request: web.Request):
        body = await body_of(request)
        ignore_unknown(body, {"new_version", "abort_all_requests"}, "update_weight_version")
        v = body.get("new_version")
        if v is None or isinstance(v, (dict, list, bool)):
            raise BadRequest("update_weight_version.new_version: required (string or int)")
        if body.get("abort_all_requests"):
            srv.engine.abort(None, "aborted for weight version update")
        await run_blocking(
            srv.engine.run_exclusive, lambda: setattr(srv.engine, "weight_version", str(v))
        )
        return web.json_response({"success": True, "weight_version": str(v)})

    async def flush_cache(request: web.Request):
        # SGLang: flushes only when no request runs or waits; 200 or 400, this text either way
        flushed = await run_blocking(srv.engine.run_exclusive, srv.engine.flush_prefix_cache)
        return web.Response(text=FLUSH_CACHE_TEXT, status=200 if flushed else 400)

    async def health(request: web.Request):
        if not srv.engine.alive():
            return error_response(503, "engine thread is dead")
        return web.json_response({"status": "ok"})

    async def get_model_info(request: web.Request):
        return web.json_response(
            {
                "model_path": srv.model_path,
                "tokenizer_path": srv.model_path,
                "is_generation": True,
                # SGLang's keys: whether /generate takes image_data, and the HF config's names
                "has_image_understanding": srv.vision is not None,
                "model_type": getattr(srv.model.config, "model_type", None),
                "architectures": getattr(srv.model.config, "architectures", None),
                "weight_version": srv.engine.weight_version,
                "vocab_size": srv.vocab_size,
                "max_context": srv.max_context,
            }
        )

    async def get_server_info(request: web.Request):
        e = srv.engine
        return web.json_response(
            {
                "model_path": srv.model_path,
                "context_length": srv.max_context,
                "max_running_requests": e.max_running,
                "num_running": e.num_running,
                "num_waiting": e.num_waiting,
                "paused": e.paused,
                "decode_steps": e.steps,
                "tokens_generated": e.tokens_generated,
                "sampling_errors": e.sampling_errors,
                "joining_groups": sorted(srv.joining),
                "prefill_tokens": e.prefill_tokens,
                "cached_tokens": e.cached_tokens,
                "forward_seconds": dict(e.forward_s),
                "process_cpu_seconds": time.process_time(),
                "prefix_cache": None if e.prefix is None else e.prefix.stats(),
                "enable_return_routed_experts": e.routes is not None,
                "receiving_buckets": srv.receiving,
                **lora_server_info(srv),
                "weight_version": e.weight_version,
                "dtype": srv.dtype_name,
                "uptime_s": time.time() - srv.started_at,
            }
        )

    app = web.Application(middlewares=[guard], client_max_size=MAX_BODY)
    post = {
        "/generate": generate,
        "/abort_request": abort_request,
        "/pause_generation": pause_generation,
        "/continue_generation": continue_generation,
        "/update_weights_from_disk": update_weights_from_disk,
        "/init_weights_update_group": init_weights_update_group,
        "/update_weights_from_distributed": update_weights_from_distributed,
        "/destroy_weights_update_group": destroy_weights_update_group,
        "/update_weight_version": update_weight_version,
        "/flush_cache": flush_cache,
    }
    for path, h in post.items():
        app.router.add_post(path, h)
    add_lora_routes(app, srv, body_of)
    for path, h in {
        "/health": health,
        "/health_generate": health,
        "/get_model_info": get_model_info,
        "/model_info": get_model_info,
        "/get_server_info": get_server_info,
        "/server_info": get_server_info,
        "/flush_cache": flush_cache,
    }.items():
        app.router.add_get(path, h)
    stopping = asyncio.Event()  # set on shutdown: pending join requests answer 503 at once

    async def on_shutdown(_app):
        stopping.set()
        await asyncio.get_running_loop().run_in_executor(None, srv.engine.shutdown)

    app.on_shutdown.append(on_shutdown)
    return app


def main(argv: Optional[list] = None) -> None:
    """CLI entry point: load the model and serve until killed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"bearer key of every request but /health* (better: {API_KEY_ENV} "
        "in the environment; argv is visible in ps)",
    )
    ap.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a non-loopback --host without an API key (logged)",
    )
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds a connection may take to send complete request headers "
        "(after opening or after its previous answer) and, separately, its "
        "body; slower connections are closed",
    )
    ap.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="answer return_routed_experts with meta_info.routed_experts "
        "(MoE models only), as SGLang's flag",
    )
    ap.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="memory budget of the prefix cache (keys/values of prompts and "
        "finished sequences reused by later requests); 0 disables it",
    )
    ap.add_argument(
        "--dtype",
        default="fp32",
        choices=sorted(MODEL_DTYPES),
        help="dtype the model is loaded and generates in (the trainer's model.dtype)",
    )
    ap.add_argument(
        "--max-images",
        type=int,
        default=DEFAULT_MAX_IMAGES,
        help="a vision-language model's limit of images per prompt (more is a 400; "
        "data.images.max_images)",
    )
    ap.add_argument("--log-level", default="WARNING")
    add_lora_flags(ap)
    args = ap.parse_args(argv)
    lora = lora_settings_of(args, ap)
    if not args.idle_timeout > 0:
        ap.error(f"--idle-timeout={args.idle_timeout}: must be > 0")
    if args.max_images < 1:
        ap.error(f"--max-images={args.max_images}: must be >= 1")
    if not args.prefix_cache_mb >= 0:
        ap.error(f"--prefix-cache-mb={args.prefix_cache_mb}: must be >= 0")
    try:
        check_bind(
            args.host,
            authenticated=bool(args.api_key),
            what=f"--host {args.host}",
            fix=f"set {API_KEY_ENV} (rollout.api_key) in the environment or --api-key, "
            "or pass --allow-unauthenticated on a trusted network",
            allow_unauthenticated=args.allow_unauthenticated,
        )
    except ConfigError as e:
        ap.error(str(e))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    torch.set_num_threads(args.num_threads)
    srv = LocalRolloutServer(
        args.model_path,
        max_running=args.max_running_requests,
        api_key=args.api_key,
        max_context=args.max_context,
        enable_return_routed_experts=args.enable_return_routed_experts,
        prefix_cache_mb=args.prefix_cache_mb,
        lora=lora,
        dtype=args.dtype,
        max_images=args.max_images,
    )
    print(
        f"local rollout server: {args.model_path} ({srv.dtype_name}) on "
        f"http://{args.host}:{args.port}",
        flush=True,
    )
    run_app_guarded(
        build_app(srv, body_timeout_s=args.idle_timeout),
        args.host,
        args.port,
        name="rollout server",
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=args.idle_timeout,
    )  # capped below the fd limit


if __name__ == "__main__":
    main()
