"""A rollout server SIGKILLed while weights travel over the distributed (gloo) weight-update
group: its in-flight request resumes on the other server with its versions kept; the
trainer's next update leaves the dead rank out of the group instead of waiting on it; the
relaunched server (same port, base model, no group) comes back *pending* and takes no
request until the following update re-forms the group with it; it then serves exactly the
trainer's weights at the trainer's version."""

import time

import numpy as np
import pytest

from areal_mega.inference.process import LocalServerProcess, launch_local_servers
from areal_mega.rewards import exact_match_reward
from areal_mega.rollout.client import RolloutClient
from areal_mega.rollout.controller import RolloutController
from areal_mega.rollout.server_pool import ElasticPool, ServerPoolCommands
from areal_mega.run_dir import RunDir
from areal_mega.train.weight_sender import DistributedWeightSender
from areal_mega.workflow.builtin import RLVRWorkflow
from tests.helpers.rollout import API_KEY, GroupSink, run, teacher_forced_logprobs
from tests.helpers.server_pool import N_NEW, check_tokens, tokens_generated, wait_for

pytestmark = pytest.mark.timeout(300)


def test_killed_server_rejoins_the_distributed_weight_group(models, tmp_path):
    procs = launch_local_servers(str(models["a"]), 2, api_key=API_KEY)
    s0, s1 = (f"http://{p.addr}" for p in procs)
    elastic = ElasticPool(
        [p.addr for p in procs],
        paths=RunDir(tmp_path, tmp_path, "", ""),
        api_key=API_KEY,
        timeout_s=120,
        retries=2,
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
    # the trainer's sender; a dead peer must not hold it for this long
    sender = DistributedWeightSender(
        RolloutClient([p.addr for p in procs], api_key=API_KEY),
        backend="gloo",
        bucket_bytes=1 << 20,
        timeout_s=60,
    )
    sender.connect()
    relaunched = None

    def publish(version, model):
        """The trainer's side of one update (session._publish_distributed); returns the
        members named, whether the group was formed again, and the seconds it took."""
        t0 = time.monotonic()
        ctl.begin_weight_update()
        begun = pool.begin_update()
        regrouped = sender.regroup(begun["servers"], force=begun["reform"])
        sender.send(list(model.state_dict().items()), weight_version=version)
        ctl.end_weight_update(version)
        pool.end_update()
        return begun["servers"], regrouped, time.monotonic() - t0

    def probe(addr, prompt):
        async def go():
            c = RolloutClient([addr], api_key=API_KEY)
            try:
                return await c.generate(prompt, {"max_new_tokens": 12, "ignore_eos": True})
            finally:
                await c.close()

        return run(go())

    try:
        assert publish(1, models["mb"])[:2] == ([s0, s1], False)

        # SIGKILL s1 while both servers generate: its request resumes on s0, versions kept
        prompts = [[5, 9, 11, 13], [6, 10, 12, 14]]
        base = tokens_generated(procs[1].addr)
        futs = [ctl.run_async(ctl.generate(p, N_NEW, key=f"k{i}")) for i, p in enumerate(prompts)]
        wait_for(lambda: tokens_generated(procs[1].addr) - base >= 20)
        procs[1].kill()
        outs = [f.result(120) for f in futs]
        for p, o in zip(prompts, outs):
            check_tokens(o, p, models["mb"], 1)
            assert o.server == s0
        assert elastic.pool_stats()["resumptions"] >= 1

        # the next update leaves the dead rank out (world 3 -> 2) instead of waiting on it
        named, regrouped, secs = publish(2, models["ma"])
        print(f"update with s1 dead: {secs:.2f}s, group world {sender.world_size}")
        assert named == [s0] and regrouped and sender.world_size == 2
        assert secs < sender.timeout_s

        # launch.local relaunches it on the same port with the base model: pending
        relaunched = LocalServerProcess(
            str(models["a"]), port=procs[1].port, api_key=API_KEY
        ).wait_ready(120)
        ctl.run_async(client.check_health(5.0)).result(60)
        assert client.dispatchable() == [s0] and elastic.pending == {s1}
        out = ctl.run_async(ctl.generate(prompts[0], 8, key="while-pending")).result(120)
        assert out.server == s0 and out.versions == [2] * 8

        # the following update re-forms the group with it (world 2 -> 3), then it serves
        named, regrouped, secs = publish(3, models["mb"])
        print(f"update re-forming with the relaunched s1: {secs:.2f}s, world {sender.world_size}")
        assert named == [s0, s1] and regrouped and sender.world_size == 3
        assert client.dispatchable() == [s0, s1] and not elastic.pending
        prompt = [5, 6, 7, 8]
        for addr in (procs[0].addr, relaunched.addr):
            res = probe(addr, prompt)
            assert res.weight_version == "3"
            ref = teacher_forced_logprobs(models["mb"], prompt + res.output_ids, len(prompt))
            err = np.abs(np.array(ref) - np.array(res.logprobs)).max()
            print(f"{addr}: max |logprob - trainer's| at v3 = {err:.2e}")
            assert err <= 1e-4
        # an unchanged membership re-forms nothing
        assert publish(4, models["ma"])[:2] == ([s0, s1], False)
    finally:
        sender.close()
        ctl.stop()
        for p in procs + [relaunched]:
            if p is not None:
                p.stop()


def test_a_port_taken_before_the_server_binds_is_replaced(models, monkeypatch, tmp_path):
    """The port a handle chose can be taken by another process before its server binds it
    (parallel test workers): the server is started again on a fresh port. A start that fails
    otherwise raises with the server's own last error."""
    import socket

    from areal_mega.common.net import free_port
    from areal_mega.inference import process

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    picks = iter([taken])
    monkeypatch.setattr(
        process, "free_port", lambda host="127.0.0.1": next(picks, None) or free_port(host)
    )
    srv = LocalServerProcess(str(models["a"]), api_key=API_KEY)
    try:
        assert srv.port == taken
        srv.wait_ready(120)
        assert srv.port != taken and srv.alive()
    finally:
        srv.stop()
        busy.close()
    bad = LocalServerProcess(str(tmp_path / "no-model"), api_key=API_KEY)
    with pytest.raises(RuntimeError, match=r"exited with code 1\n  last error: \w+"):
        bad.wait_ready(120)
    bad.stop()
