"""Elastic rollout against real CPU rollout servers (areal_mega.rollout.server_pool): a joining
server serves the current weights and version before its first request; a server removed
mid-generation has its requests resumed elsewhere from their partial output (tokens keep
their versions and are the teacher-forced tokens of the weights that made them); a drained
server finishes its requests, unless its drain deadline passes first (the rest is interrupted
and resumes elsewhere); bad requests change nothing."""

import shutil

import numpy as np
import pytest

from areal_mega.common.net import free_port
from areal_mega.inference.process import launch_local_servers
from areal_mega.rewards import exact_match_reward
from areal_mega.rollout.client import RolloutClient
from areal_mega.rollout.controller import RolloutController
from areal_mega.rollout.server_pool import ElasticPool, ServerPoolCommands, ServerPoolError
from areal_mega.run_dir import RunDir
from areal_mega.workflow.builtin import RLVRWorkflow
from tests.helpers.rollout import API_KEY, GroupSink, run, teacher_forced_logprobs
from tests.helpers.server_pool import N_NEW, check_tokens, tokens_generated, wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def servers(models):
    procs = launch_local_servers(str(models["a"]), 2, api_key=API_KEY)
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def members(elastic):
    return [s["addr"] for s in elastic.pool_stats()["servers"]]


def test_join_remove_drain_and_bad_requests(servers, models, tmp_path):
    s0, s1 = (f"http://{p.addr}" for p in servers)
    paths = RunDir(tmp_path, tmp_path / "ckpt", "", "")
    shutil.copytree(models["b"], paths.weights_dir(1))  # the trainer published v1 = b
    elastic = ElasticPool(
        [servers[0].addr], paths=paths, api_key=API_KEY, timeout_s=120, retries=4, backoff_s=0.05
    )
    client = elastic.client
    wf = RLVRWorkflow(exact_match_reward, 4)
    ctl = RolloutController(
        client, wf, iter(()), batch_size=2, n_samples=2, eta=1, sink=GroupSink(), ignore_eos=True
    ).start()
    pool = ServerPoolCommands(elastic, lambda: ctl)
    try:
        ctl.update_weights(1, path=str(paths.weights_dir(1)))

        # bad requests: clear errors, nothing changes
        bad = [
            ({"cmd": "remove_server", "addr": "127.0.0.1:1"}, "not in the pool"),
            ({"cmd": "remove_server", "addr": servers[0].addr}, "last server"),
            ({"cmd": "add_server", "addr": f"127.0.0.1:{free_port()}"}, "unreachable"),
            ({"cmd": "add_server", "addr": "no-port"}, "expected host:port"),
            ({"cmd": "add_server", "addr": servers[0].addr}, "already in the pool"),
            ({"cmd": "add_server"}, "'addr'"),
        ]
        for msg, words in bad:
            with pytest.raises(ServerPoolError, match=words):
                pool.handle(msg)
            assert members(elastic) == [s0]

        # s1 boots with model a at version 0; it joins at the current version 1 with b
        joined = pool.handle({"cmd": "add_server", "addr": servers[1].addr})
        assert joined["version"] == 1 and members(elastic) == [s0, s1]

        async def probe():  # s1 alone, as the trainer would check it
            c = RolloutClient([servers[1].addr], api_key=API_KEY)
            try:
                return await c.generate([5, 6, 7], {"max_new_tokens": 8, "ignore_eos": True})
            finally:
                await c.close()

        res = run(probe())
        assert res.weight_version == "1"
        ref = teacher_forced_logprobs(models["mb"], [5, 6, 7] + res.output_ids, 3)
        assert np.abs(np.array(ref) - np.array(res.logprobs)).max() <= 1e-4

        # remove s1 without draining while both servers generate: its request is aborted
        # and resumed on s0 from its partial output
        prompts = [[5, 9, 11, 13], [6, 10, 12, 14]]
        base = tokens_generated(servers[1].addr)
        futs = [ctl.run_async(ctl.generate(p, N_NEW, key=f"k{i}")) for i, p in enumerate(prompts)]
        wait_for(lambda: tokens_generated(servers[1].addr) - base >= 20)
        gone = pool.handle({"cmd": "remove_server", "addr": servers[1].addr})
        assert gone["aborted"] == 1 and members(elastic) == [s0]
        outs = [f.result(120) for f in futs]
        assert sorted(o.n_interruptions for o in outs) == [0, 1]
        for p, o in zip(prompts, outs):
            check_tokens(o, p, models["mb"], 1)
            assert o.server == s0
        stats = elastic.pool_stats()
        assert stats["resumptions"] == 1 and stats["joins"] == 1 and stats["removals"] == 1

        # s1 joins again, then s0 leaves with --drain: its request finishes there
        pool.handle({"cmd": "add_server", "addr": servers[1].addr})
        futs = [ctl.run_async(ctl.generate(p, N_NEW, key=f"d{i}")) for i, p in enumerate(prompts)]
        wait_for(lambda: elastic.pool_stats()["servers"][0]["inflight"] == 1)
        gone = pool.handle({"cmd": "remove_server", "addr": servers[0].addr, "drain": True})
        assert gone["aborted"] == 0 and gone["drained"] and members(elastic) == [s1]
        outs = [f.result(120) for f in futs]
        assert [o.n_interruptions for o in outs] == [0, 0]
        assert sorted(o.server for o in outs) == sorted([s0, s1])
        for p, o in zip(prompts, outs):
            check_tokens(o, p, models["mb"], 1)
        stats = elastic.pool_stats()
        assert stats["live_servers"] == 1 and stats["resumptions"] == 1
        assert stats["servers"][0]["requests"] >= 2 and stats["servers"][0]["tokens"] >= N_NEW

        # a drain cut short by its deadline (the launcher's operation timeout): the rest is
        # interrupted and resumes on s0; s1 is removed all the same, and the answer says so
        pool.handle({"cmd": "add_server", "addr": servers[0].addr})
        futs = [ctl.run_async(ctl.generate(p, N_NEW, key=f"t{i}")) for i, p in enumerate(prompts)]
        wait_for(lambda: all(s["inflight"] == 1 for s in elastic.pool_stats()["servers"]))
        gone = pool.handle(
            {"cmd": "remove_server", "addr": servers[1].addr, "drain": True, "drain_timeout_s": 0}
        )
        assert gone["drain_timed_out"] and not gone["drained"] and gone["aborted"] == 1
        assert members(elastic) == [s0]
        outs = [f.result(120) for f in futs]
        assert sorted(o.n_interruptions for o in outs) == [0, 1]
        assert all(o.server == s0 for o in outs)
    finally:
        ctl.stop()


def test_join_through_the_distributed_weight_group(servers, models, tmp_path):
    """Distributed weight updates (gloo on CPU): a joining server waits, without requests,
    for the trainer's next update, which forms the group again with it (world size 2 -> 3)
    and broadcasts; it then serves exactly the trainer's weights at the trainer's version. A
    removal during the broadcast is refused; after one, the group shrinks again."""
    from areal_mega.train.weight_sender import DistributedWeightSender

    s0, s1 = (f"http://{p.addr}" for p in servers)
    elastic = ElasticPool(
        [servers[0].addr],
        paths=RunDir(tmp_path, tmp_path, "", ""),
        api_key=API_KEY,
        timeout_s=120,
        retries=4,
        backoff_s=0.05,
    )
    client = elastic.client
    ctl = RolloutController(
        client,
        RLVRWorkflow(exact_match_reward, 4),
        iter(()),
        batch_size=2,
        n_samples=2,
        eta=1,
        sink=GroupSink(),
        ignore_eos=True,
    ).start()
    pool = ServerPoolCommands(elastic, lambda: ctl)
    sender = DistributedWeightSender(
        RolloutClient([servers[0].addr], api_key=API_KEY),
        backend="gloo",
        bucket_bytes=1 << 20,
        timeout_s=120,
    )
    sender.connect()

    def publish(version, model, members):
        """The trainer's side of one update (session.publish_weights, distributed)."""
        ctl.begin_weight_update()
        named = pool.begin_update()["servers"]
        assert named == members
        if version == 1:  # mid-broadcast the group's ranks cannot leave
            with pytest.raises(ServerPoolError, match="broadcast is in progress"):
                pool.handle({"cmd": "remove_server", "addr": servers[1].addr})
        regrouped = sender.regroup(named)
        sender.send(list(model.state_dict().items()), weight_version=version)
        ctl.end_weight_update(version)
        pool.end_update()
        return regrouped

    try:
        joined = pool.handle({"cmd": "add_server", "addr": servers[1].addr, "via_group": True})
        assert joined["pending"] and joined["version"] is None
        assert client.dispatchable() == [s0]  # no request before its weights
        assert publish(1, models["mb"], [s0, s1]) and sender.world_size == 3
        assert client.dispatchable() == [s0, s1] and not sender.regroup([s0, s1])
        prompt = [5, 6, 7, 8]
        for p in servers:  # each server: the trainer's logprobs at the trainer's version

            async def probe(addr=p.addr):
                c = RolloutClient([addr], api_key=API_KEY)
                try:
                    return await c.generate(prompt, {"max_new_tokens": 12, "ignore_eos": True})
                finally:
                    await c.close()

            res = run(probe())
            assert res.weight_version == "1"
            ref = teacher_forced_logprobs(models["mb"], prompt + res.output_ids, len(prompt))
            assert np.abs(np.array(ref) - np.array(res.logprobs)).max() <= 1e-4
        pool.handle({"cmd": "remove_server", "addr": servers[0].addr})
        assert publish(2, models["ma"], [s1]) and sender.world_size == 2
        out = ctl.run_async(ctl.generate(prompt, 12, key="after")).result(120)
        assert out.server == s1 and out.versions == [2] * 12
        ref = teacher_forced_logprobs(models["ma"], prompt + out.output_ids, len(prompt))
        assert np.abs(np.array(ref) - np.array(out.logprobs)).max() <= 1e-4
    finally:
        sender.close()
        ctl.stop()
