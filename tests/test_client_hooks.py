"""The rollout client's public server set and its hooks (composition instead of subclassing),
without a model: closed ports stand in for dead servers, a tiny aiohttp app for a live one."""

import asyncio
import socket

import pytest
from aiohttp import web

from areal_mega.rollout.client import ClientHooks, RolloutClient, RolloutServerError, server_url


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_set_is_public_and_keyed_by_url():
    a, b = f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}"
    c = RolloutClient([a])
    assert c.addrs == [server_url(a)] == [f"http://{a}"]
    assert c.add_server(b) == f"http://{b}" and c.addrs == [f"http://{a}", f"http://{b}"]
    with pytest.raises(ValueError, match="already a member"):
        c.add_server(f"http://{b}")
    c.mark_down(b, OSError("gone"))
    assert not c.is_healthy(b) and c.live_servers() == [f"http://{a}"]
    c.mark_up(b)
    assert c.is_healthy(b) and c.inflight(b) == 0
    c.remove_server(a)
    assert c.addrs == [f"http://{b}"]
    with pytest.raises(ValueError, match="not a member"):
        c.remove_server(a)
    c.mark_down(a, OSError("gone"))  # a non-member: ignored
    assert not c.is_healthy(a)
    c.mark_down(b, OSError("gone"))
    c.set_servers([a, b])  # as a fresh client: every server healthy
    assert c.addrs == [f"http://{a}", f"http://{b}"] and c.live_servers() == c.addrs
    with pytest.raises(ValueError):
        c.set_servers([])


class Recorder(ClientHooks):
    """Blocks one address, waits a little for a server, counts the /generate outcomes."""

    down_wait_s = 0.3
    serial_checks = True

    def __init__(self, blocked=()):
        self.block, self.ok, self.failed, self.probed = set(blocked), [], [], []

    def blocked(self):
        return set(self.block)

    async def probe(self, client, addr, healthy, timeout):
        self.probed.append(addr)
        await super().probe(client, addr, healthy, timeout)

    def generated(self, addr, out):
        self.ok.append((addr, out["output_ids"]))

    def generate_failed(self, addr, error):
        self.failed.append(addr)


async def _serve():
    async def generate(request):
        return web.json_response(
            {
                "output_ids": [7],
                "meta_info": {
                    "output_token_logprobs": [[-0.5, 7]],
                    "finish_reason": {"type": "stop"},
                },
            }
        )

    async def health(request):
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = closed_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"127.0.0.1:{port}"


def test_hooks_choose_probe_observe_and_wait():
    async def go():
        runner, live = await _serve()
        dead, blocked = f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}"
        hooks = Recorder(blocked=[f"http://{blocked}"])
        c = RolloutClient([dead, blocked, live], hooks=hooks, retries=3, backoff_s=0.01)
        try:
            assert c.dispatchable() == [f"http://{dead}", f"http://{live}"]
            res = await c.generate([1, 2], {"max_new_tokens": 1}, rid="r")
            # the blocked server is never tried; the dead one fails over to the live one
            assert res.server == f"http://{live}" and res.output_ids == [7]
            assert hooks.ok == [(f"http://{live}", [7])]
            assert hooks.failed == [f"http://{dead}"]  # least loaded, first listed
            assert await c.check_health(1.0) == [False, False, True]
            assert sorted(hooks.probed[-3:]) == sorted(c.addrs)
            assert c.live_servers() == [f"http://{live}"]
            assert await c.wait_for_server(0.0)
        finally:
            await c.close()
            await runner.cleanup()

        # every server dead: generate waits hooks.down_wait_s for one, then fails
        c = RolloutClient([dead], hooks=Recorder(), retries=0, backoff_s=0.01)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(RolloutServerError):
            await c.generate([1], {"max_new_tokens": 1})
        assert loop.time() - t0 >= 0.3
        await c.close()

    asyncio.run(go())
