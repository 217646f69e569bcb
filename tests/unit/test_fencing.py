"""When a node of a multi-node job that lost etcd stops its workers (agent/etcd/membership.py should_fence)."""

from trainwarden.agent.etcd.membership import should_fence


def test_a_node_cut_off_from_etcd_and_its_peers_is_fenced_once_its_lease_lapsed():
    assert not should_fence(unconfirmed_s=8, ttl_s=10, median_step_s=0.5, since_last_step_s=None)
    assert should_fence(unconfirmed_s=11, ttl_s=10, median_step_s=0.5, since_last_step_s=None)


def test_an_etcd_outage_every_node_sees_fences_nobody_while_the_workers_step_together():
    assert not should_fence(unconfirmed_s=60, ttl_s=10, median_step_s=0.5, since_last_step_s=0.4)


def test_steps_taken_before_the_partition_do_not_keep_a_node_in():
    """The workers stepped after etcd's last confirmation, then stalled when the link went: fenced once they
    have been stalled as long as the lease."""
    assert not should_fence(unconfirmed_s=12, ttl_s=10, median_step_s=0.5, since_last_step_s=9)
    assert should_fence(unconfirmed_s=13, ttl_s=10, median_step_s=0.5, since_last_step_s=10.5)


def test_a_job_of_long_steps_is_not_fenced_between_two_of_them():
    assert not should_fence(unconfirmed_s=25, ttl_s=10, median_step_s=10.0, since_last_step_s=None)
    assert should_fence(unconfirmed_s=31, ttl_s=10, median_step_s=10.0, since_last_step_s=None)
    assert should_fence(unconfirmed_s=11, ttl_s=10, median_step_s=None, since_last_step_s=None)
