"""Multi-node placement on a simulated 2-node Ray cluster (`ray.cluster_utils.Cluster`): node labels are
custom resources; each pool lands on the nodes its config names, and resizing one pool leaves the
other's placement group and actors untouched."""

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from sparrow.coordinator.config import load_config  # noqa: E402
from sparrow.coordinator.pools import PlacementError, RolloutPool, TrainerPool  # noqa: E402
from sparrow.coordinator.transport import JobCredentials  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"trainer_node": 1}, "include_dashboard": False,
    })
    worker = cluster.add_node(num_cpus=2, resources={"rollout_node": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield {"trainer": cluster.head_node.node_id, "rollout": worker.node_id}
    ray.shutdown()
    cluster.shutdown()


def _config(model, rollout_size: int):
    return load_config(None, [
        f"model={model}", f"rollout.pool.size={rollout_size}", "rollout.pool.cpus=0.5", "rollout.pool.node_label=rollout_node",
        "rollout.native.max_num_seqs=8", "rollout.native.num_kv_blocks=64", "rollout.schedule=dense",
        "trainer.pool.size=2", "trainer.pool.cpus=0.5", "trainer.pool.node_label=trainer_node",
        "metrics.enabled=false", "rollout.pool.ready_timeout_s=30", "trainer.pool.ready_timeout_s=30",
    ])


def _workers(pool: RolloutPool) -> list[dict]:
    schedule = pool.config.schedule_template()
    return ray.get([pool.spawn(slot, schedule).info.remote() if slot.actor is None else slot.actor.info.remote()
                    for slot in pool.slots.values()])


def test_pools_land_on_their_labelled_nodes_and_resize_independently(two_nodes, tiny_qwen3):
    config = _config(tiny_qwen3, 1)
    credentials = JobCredentials.create(config.transport)
    rollouts = RolloutPool(config, str(tiny_qwen3), credentials)
    rollouts.add_slot(wait_s=30)
    trainers = TrainerPool(config.trainer.pool, config.trainer_config(str(tiny_qwen3)), credentials)
    try:
        assert [w["node_id"] for w in _workers(rollouts)] == [two_nodes["rollout"]]
        assert [n["node_id"] for n in trainers.call("node")] == [two_nodes["trainer"]] * 2
        before = {
            "actors": [a._actor_id.hex() for a in trainers.actors],
            "group": trainers.placement_group.id.hex(),
            "bundles": placement_group_table(trainers.placement_group)["bundles"],
        }

        # Grow the rollout pool (1 -> 2 workers): a slot of its own; the trainer pool is not touched.
        rollouts.add_slot(wait_s=30)
        assert [w["node_id"] for w in _workers(rollouts)] == [two_nodes["rollout"]] * 2
        assert [a._actor_id.hex() for a in trainers.actors] == before["actors"]
        assert trainers.placement_group.id.hex() == before["group"]
        assert placement_group_table(trainers.placement_group)["bundles"] == before["bundles"]
        assert [n["rank"] for n in trainers.call("node")] == [0, 1], "the trainer ranks kept running"
        assert ray.get(trainers.rank0.address.remote())
    finally:
        rollouts.shutdown()
        trainers.shutdown()


def test_a_placed_slot_reads_ready_every_time_and_an_unplaceable_one_never(two_nodes, tiny_qwen3):
    """What the fleet asks before spawning a replacement (PlacementGroup.wait(0) gave False for placed groups)."""
    config = _config(tiny_qwen3, 1)
    rollouts = RolloutPool(config, str(tiny_qwen3), JobCredentials.create(config.transport))
    try:
        placed = rollouts.add_slot(wait_s=30)
        assert all(rollouts.ready(placed) for _ in range(200))
        too_big = load_config(None, [f"model={tiny_qwen3}", "rollout.pool.cpus=2", "rollout.pool.node_label=rollout_node"])
        rollouts.config = too_big  # the node's 2 CPUs hold 0.5 already: a 2-CPU bundle waits
        waiting = rollouts.add_slot()
        assert not any(rollouts.ready(waiting) for _ in range(20))
    finally:
        rollouts.shutdown()


def test_pools_that_cannot_fit_fail_at_once_naming_the_resource(two_nodes, tiny_qwen3):
    unlabelled = load_config(None, [f"model={tiny_qwen3}", "rollout.pool.node_label=gpu_node"])
    credentials = JobCredentials.create(unlabelled.transport)
    with pytest.raises(PlacementError, match="rollout pool .*gpu_node: needs 0.001, cluster has 0.*--resources"):
        RolloutPool(unlabelled, str(tiny_qwen3), credentials)
    too_big = load_config(None, [f"model={tiny_qwen3}", "rollout.pool.size=3", "rollout.pool.cpus=2"])
    with pytest.raises(PlacementError, match="CPU: needs 6, cluster has 4"):
        RolloutPool(too_big, str(tiny_qwen3), credentials)


def test_a_local_cluster_declares_the_machines_cores_so_a_resized_pool_has_room():
    """On 4 x H200 a local job with 6-CPU workers declared 12 CPUs (what its pools reserved at start), so a
    rollout pool resized from 1 to 3 workers found no room on a 64-core machine."""
    from sparrow.coordinator.config import load_config
    from sparrow.coordinator.ray_session import local_cpus

    config = load_config(None, ["rollout.pool={size: 1, cpus: 6}", "trainer.pool={size: 1, cpus: 6}"])
    assert local_cpus(config, cores=64) == 64
    assert local_cpus(config, cores=2) == 12  # pools reserving more than the cores still fit
