"""SGLang's LoRA API on the CPU rollout server: the flags, ``POST /load_lora_adapter``,
``POST /unload_lora_adapter`` and ``/generate``'s ``lora_path`` (the rules are SGLang's, see
:mod:`areal_mega.inference.lora_adapters`; the per-row forward is
:mod:`areal_mega.inference.lora_layers`).

* ``/load_lora_adapter`` ``{"lora_name", "lora_path", "pinned": false}`` and
  ``/unload_lora_adapter`` ``{"lora_name"}`` answer ``{"success", "error_message",
  "loaded_adapters": {name: path}}``, HTTP 200 on success and 400 otherwise (the server keeps
  serving): also for a ``lora_path`` outside ``--lora-allowed-dirs`` (symlinks resolved; the
  answer is the same whether it exists) and for unreadable or malformed adapter files (truncated,
  garbage, rank 0 or null). Unloading answers once the requests using the adapter have finished; in
  a
  trainer's swap (``/pause_generation``, load the new version, unload the old one,
  ``/continue_generation``) the pause has aborted them already, so it answers at once;
* ``/generate``'s ``lora_path`` is an adapter name for every prompt, or a list with one name
  (or null: the base model) per prompt; a name that is not loaded, or any name on a server
  without ``--enable-lora``, is a 400 naming it. While generation is paused the names are
  resolved after ``/continue_generation`` (SGLang waits for the pause before acquiring the
  adapters), so a request queued during a swap never pins the adapter being unloaded.
  ``lora_id`` (SGLang's internal id, filled from ``lora_path``) is ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import functools

from aiohttp import web

from areal_mega.inference.http_api import BadRequest, get_field, ignore_unknown
from areal_mega.inference.lora_adapters import SUPPORTED_TARGETS, LoraSettings, lora_settings

__all__ = [
    "add_lora_flags",
    "add_lora_routes",
    "lora_server_info",
    "lora_settings_of",
    "release_adapters",
    "resolve_adapters",
]


def add_lora_flags(ap: argparse.ArgumentParser) -> None:
    """SGLang's LoRA server flags."""
    ap.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters (implied by --lora-paths)",
    )
    ap.add_argument("--max-lora-rank", type=int, default=None)
    ap.add_argument(
        "--lora-target-modules", nargs="*", default=None, choices=[*SUPPORTED_TARGETS, "all"]
    )
    ap.add_argument(
        "--lora-paths",
        nargs="*",
        default=None,
        help="adapters to load at start: NAME=PATH, PATH or "
        '\'{"lora_name":..,"lora_path":..,"pinned":..}\'',
    )
    ap.add_argument("--max-loras-per-batch", type=int, default=8)
    ap.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="adapters held at once (least recently used evicted beyond it); "
        "default: 64, at least --max-loras-per-batch",
    )
    ap.add_argument(
        "--lora-allowed-dirs",
        nargs="*",
        default=None,
        metavar="DIR",
        help="directories /load_lora_adapter may read adapters from (symlinks "
        "resolved; none given: it loads nothing); not SGLang's",
    )


def lora_settings_of(args: argparse.Namespace, ap: argparse.ArgumentParser) -> LoraSettings:
    """The checked settings of parsed flags (``ap.error`` naming the flag otherwise)."""
    if args.enable_lora is False:
        return LoraSettings()
    try:
        return lora_settings(
            bool(args.enable_lora),
            args.max_lora_rank,
            args.lora_target_modules,
            args.lora_paths,
            args.max_loras_per_batch,
            args.max_loaded_loras,
            args.lora_allowed_dirs,
        )
    except ValueError as e:
        ap.error(str(e))


def _update_answer(srv, ok: bool, message: str = "") -> web.Response:
    loaded = srv.lora_registry.loaded_adapters() if srv.lora_settings.enabled else None
    return web.json_response(
        {"success": ok, "error_message": message, "loaded_adapters": loaded},
        status=200 if ok else 400,
    )


def _state(srv) -> asyncio.Condition:
    """The condition unloads wait on (made on the serving loop)."""
    cond = getattr(srv, "_lora_cond", None)
    if cond is None:
        cond = srv._lora_cond = asyncio.Condition()
    return cond


async def _load(srv, name: str, path: str, pinned: bool) -> None:
    """Read, check and register one adapter (ValueError with SGLang's message); a path other
    than the operator's ``--lora-paths`` entry of that name only inside
    ``--lora-allowed-dirs``."""
    srv.lora_registry.check_load(name, pinned)
    preloaded = any(
        p["lora_name"] == name and p["lora_path"] == path for p in srv.lora_settings.preload
    )
    adapter = await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(srv.read_lora_adapter, name, path, pinned, confined=not preloaded)
    )
    srv.lora_registry.add(adapter)


async def resolve_adapters(srv, body: dict, n_prompts: int) -> list:
    """The adapter (or None) of each prompt of a ``/generate`` body, counted as in use until
    :func:`release_adapters` (400 naming a bad or unknown ``lora_path``)."""
    names = body.get("lora_path")
    if names is None or names == []:
        return [None] * n_prompts
    if isinstance(names, str):
        names = [names] * n_prompts
    elif not (isinstance(names, list) and all(n is None or isinstance(n, str) for n in names)):
        raise BadRequest(
            f"generate.lora_path={names!r}: expected an adapter name or a list of names (or nulls)"
        )
    elif len(names) != n_prompts:
        raise BadRequest(f"generate.lora_path: {len(names)} names for {n_prompts} prompts")
    if all(n is None for n in names):
        return [None] * n_prompts
    while srv.engine.paused:  # SGLang resolves adapters once the pause is over
        await asyncio.sleep(0.02)
    reg = srv.lora_registry
    try:
        for name, path, pinned in reg.to_reload(names):
            try:
                await _load(srv, name, path, pinned)
            except ValueError:
                if name not in reg.loaded:  # not reloaded by a concurrent request either
                    raise
        adapters = reg.lookup(names)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    for a in {id(a): a for a in adapters if a is not None}.values():
        a.in_flight += 1
    return adapters


async def release_adapters(srv, adapters: list) -> None:
    """The requests of one ``/generate`` have finished: wake unloads waiting for them."""
    used = {id(a): a for a in adapters if a is not None}
    if not used:
        return
    for a in used.values():
        a.in_flight -= 1
    cond = _state(srv)
    async with cond:
        cond.notify_all()


def add_lora_routes(app: web.Application, srv, body_of) -> None:
    """Serve ``/load_lora_adapter`` and ``/unload_lora_adapter`` for ``srv`` (a
    :class:`~areal_mega.inference.server_state.LocalRolloutServer`); ``body_of(request)``
    reads a JSON body."""

    async def load_lora_adapter(request: web.Request):
        body = await body_of(request)
        w = "load_lora_adapter"
        ignore_unknown(body, {"lora_name", "lora_path", "pinned", "lora_id"}, w)
        name = get_field(body, "lora_name", str, where=w, required=True)
        path = get_field(body, "lora_path", str, where=w, required=True)
        pinned = get_field(body, "pinned", bool, False, w)
        try:
            await _load(srv, name, path, pinned)
        except ValueError as e:
            return _update_answer(srv, False, str(e))
        return _update_answer(srv, True)

    async def unload_lora_adapter(request: web.Request):
        body = await body_of(request)
        w = "unload_lora_adapter"
        ignore_unknown(body, {"lora_name", "lora_id"}, w)
        name = get_field(body, "lora_name", str, where=w, required=True)
        try:
            adapter = srv.lora_registry.remove(name)
        except ValueError as e:
            return _update_answer(srv, False, str(e))
        cond = _state(srv)
        async with cond:  # SGLang: unload once no request uses it
            await cond.wait_for(lambda: adapter.in_flight <= 0)
        return _update_answer(srv, True)

    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)


def lora_server_info(srv) -> dict:
    """The LoRA part of ``/get_server_info``: SGLang's server-args names plus the loaded
    adapters (name -> path)."""
    info = srv.lora_settings.info()
    info["loaded_adapters"] = srv.lora_registry.loaded_adapters()
    return info
