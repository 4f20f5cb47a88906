from rl.orchestrator.versions import VersionTracker


def test_tokens_split_at_reload():
    t = VersionTracker(3)
    t.start("a")
    t.start("b")
    t.on_reload(4, {"a": 5, "b": 0})
    t.start("c")
    t.on_reload(5, {"a": 7, "c": 2})
    assert t.finish("a", 9) == [3] * 5 + [4] * 2 + [5] * 2
    assert t.finish("b", 3) == [4, 4, 4]  # b never got a token from version 3; absent at the 2nd reload
    assert t.finish("c", 4) == [4, 4, 5, 5]
    assert t.ambiguous == 1


def test_absent_request_keeps_older_version():
    t = VersionTracker(0)
    t.start("x")
    t.on_reload(1, {})
    assert t.finish("x", 3) == [0, 0, 0]


def test_counts_beyond_length_are_clamped():
    t = VersionTracker(0)
    t.start("x")
    t.on_reload(1, {"x": 10})
    assert t.finish("x", 4) == [0, 0, 0, 0]


def test_groups_outside_the_off_policy_bound_are_dropped():
    from rl.contract.batch import Sample
    from rl.orchestrator.loop import within_off_policy_bound

    def s(versions, mask=None):
        return Sample([1], [2] * len(versions), [0.0] * len(versions), versions, 0.0, 0, completion_mask=mask)
    assert within_off_policy_bound([s([4, 5]), s([5])], step=5, max_off_policy=1)
    assert not within_off_policy_bound([s([3, 4, 5]), s([5])], step=5, max_off_policy=1)  # spans too far
    assert within_off_policy_bound([s([3, 4, 5])], step=5, max_off_policy=2)
    assert not within_off_policy_bound([s([4])], step=5, max_off_policy=0)  # fully on-policy
    # observation tokens (mask 0, version -1) never count
    assert within_off_policy_bound([s([5, -1, 5], mask=[1, 0, 1])], step=5, max_off_policy=0)


def test_published_runs_ahead_of_the_servers_and_wakes_the_listeners():
    """The trainer waits for batch n from the moment it publishes version n, not once the servers load it."""
    t = VersionTracker(2)
    seen = []
    t.listeners.append(lambda: seen.append((t.published, t.version)))
    t.on_published(3)
    t.on_published(3)          # no news: no wake
    assert (t.published, t.version, seen) == (3, 2, [(3, 2)])
    t.on_reload(3, {})
    assert seen[-1] == (3, 3)
    t.version = 5              # set directly (tests' stand-in trainers): published never lags it
    assert t.published == 5
