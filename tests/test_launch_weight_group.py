"""The weight-update group (trainer rank 0 + every rank of every rollout server) comes from the
allocation string alone: for every recipe, the launcher's SGLang command lines and the trainer's
sender agree on the world size and each server's rank offset (a mismatch hangs the broadcast)."""

from pathlib import Path

import pytest

from areal_mega.config import ConfigError, load_config
from areal_mega.launch import local
from areal_mega.parallel.allocation import parse_allocation
from areal_mega.parallel.weight_group import WeightGroup, weight_update_group
from areal_mega.train.session import weight_group_for

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def _launched_ranks(cfg, slot) -> int:
    """Ranks of one server as the launcher starts it: SGLang's --tp-size, else one process."""
    argv = local.server_command(cfg, slot, "127.0.0.1")  # 0.0.0.0 would need rollout.api_key
    return int(argv[argv.index("--tp-size") + 1]) if "--tp-size" in argv else 1


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_weight_group_matches_launched_servers(recipe):
    cfg = load_config(recipe)
    alloc = parse_allocation(cfg.allocation)
    lay = local.planned_layout(cfg)
    assert len(lay.servers) == alloc.rollout.dp
    ranks = [_launched_ranks(cfg, s) for s in lay.servers]
    # the allocation string is the authority: d servers of t ranks each (t·p GPUs, p = 1 here)
    assert alloc.rollout.pp == 1
    assert ranks == [alloc.rollout.tp if cfg.rollout.backend == "sglang" else 1] * alloc.rollout.dp
    want_offsets = tuple(1 + sum(ranks[:i]) for i in range(len(ranks)))
    want = WeightGroup(1 + sum(ranks), want_offsets, ranks[0])
    assert weight_update_group(alloc, cfg.rollout.backend) == want  # launcher
    # the trainer's sender, after the launcher filled rollout.server_addrs in
    hosts = [f"10.0.0.{n}" for n in range(cfg.cluster.n_nodes)]
    addrs = local.layout_env(cfg, hosts)["SERVER_ADDRS"]
    joined = load_config(recipe, [f"rollout.server_addrs={addrs}"])
    assert len(joined.rollout.server_addrs) == len(ranks)
    assert weight_group_for(joined) == want
    if cfg.rollout.backend == "sglang":  # every GPU of the rollout part is one group rank
        assert want.world_size == 1 + alloc.rollout_world_size


def test_moe_recipe_group_is_one_plus_four_by_four():
    """qwen3-30b-a3b (sglang:d4t4): 17 ranks, servers at 1, 5, 9, 13 — not 1 + 4x1."""
    cfg = load_config(ROOT / "recipes" / "qwen3-30b-a3b-math.yaml")
    group = weight_update_group(parse_allocation(cfg.allocation), "sglang")
    assert group == WeightGroup(17, (1, 5, 9, 13), 4)
    assert "group world 17" in local.describe(cfg) and "rank offsets 1, 5, 9, 13" in local.describe(
        cfg
    )
    assert local.layout_env(cfg)["WEIGHT_GROUP_WORLD_SIZE"] == 17


def test_sglang_tp_key_is_gone():
    with pytest.raises(ConfigError, match="rollout.sglang_tp"):
        load_config(ROOT / "recipes" / "tiny-cpu.yaml", ["rollout.sglang_tp=4"])


def test_weight_group_errors_name_the_key():
    sg = parse_allocation("sglang:d2t4+megatron:d8")
    with pytest.raises(ConfigError, match="rollout.server_addrs: 3 server"):
        weight_update_group(sg, "sglang", 3)
    with pytest.raises(ConfigError, match="rollout.backend='local'"):
        weight_update_group(sg, "local")
    with pytest.raises(ConfigError, match="no rollout part"):  # TP of external servers
        weight_update_group(parse_allocation("megatron:d8"), "sglang", 2)
    with pytest.raises(ConfigError, match="p>1"):
        weight_update_group(parse_allocation("sglang:d2t2p2+megatron:d8"), "sglang")
    # local servers are one process each, with or without a rollout part
    assert weight_update_group(parse_allocation("megatron:d2"), "local", 3) == WeightGroup(
        4, (1, 2, 3), 1
    )
    assert weight_update_group(sg, "sglang", 2) == WeightGroup(9, (1, 5), 4)
    # the dry run refuses a trainer that would join external SGLang servers of unknown TP
    cfg = load_config(
        ROOT / "recipes" / "qwen2.5-7b-math.yaml",
        ["allocation=megatron:d4t2", "rollout.server_addrs=10.0.0.1:30000"],
    )
    with pytest.raises(ConfigError, match="allocation='megatron"):
        local.describe(cfg)
