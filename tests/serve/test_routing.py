"""`serve --replicas`'s routing policy without Ray: the approximate radix tree of the
prefixes each replica was sent, `choose_prefix` on crafted prompts and loads, pow2,
round-robin, `Router`'s bookkeeping; and the one error line of `--replicas` where Ray is
not installed. (The policy at scale, against simulated replicas:
tests/unit/runtime/test_cluster_sim.py.)"""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dynalm.runtime.serve.routing import (
    PrefixTree,
    Router,
    choose_pow2,
    choose_prefix,
    choose_round_robin,
)

SYSTEM_A = list(range(100, 200))  # two 100-token "system prompts"
SYSTEM_B = list(range(300, 400))


def test_the_longest_match_names_who_holds_it_across_split_edges() -> None:
    tree = PrefixTree()
    tree.insert([1, 2, 3, 4], "r0")
    tree.insert([1, 2, 5], "r1")  # splits r0's edge after [1, 2]
    assert tree.match([1, 2, 3, 4, 9], ["r0", "r1"]) == (4, ["r0"])
    assert tree.match([1, 2, 3], ["r0", "r1"]) == (3, ["r0"])  # inside an edge
    n, holders = tree.match([1, 2, 9], ["r0", "r1"])
    assert (n, sorted(holders)) == (2, ["r0", "r1"])
    assert tree.match([1, 2, 3, 4], ["r1"]) == (2, ["r1"])  # only the candidates count
    assert tree.match([7, 8], ["r0", "r1"]) == (0, [])
    assert tree.sizes == {"r0": 4, "r1": 3}  # [1, 2] + [3, 4]; [1, 2] + [5]


def test_balanced_loads_follow_the_prefix_imbalanced_ones_the_load() -> None:
    tree = PrefixTree()
    tree.insert(SYSTEM_A + [1, 2], "r0")
    tree.insert(SYSTEM_B + [3], "r1")
    question = SYSTEM_A + [5, 6, 7]
    order, matched, by_load, _ = choose_prefix(tree, question, {"r0": 3, "r1": 0}, imbalance=3)
    assert (order, matched, by_load) == (["r0", "r1"], 100, False)
    order, matched, by_load, _ = choose_prefix(tree, question, {"r0": 4, "r1": 0}, imbalance=3)
    assert (order, by_load) == (["r1", "r0"], True)
    assert matched == 0  # r1 never saw SYSTEM_A
    order, _, _, _ = choose_prefix(tree, SYSTEM_B + [9], {"r0": 0, "r1": 2}, imbalance=3)
    assert order[0] == "r1"


def test_a_new_prefix_goes_to_the_smallest_tree_then_the_least_loaded() -> None:
    tree = PrefixTree()
    tree.insert(SYSTEM_A, "r0")
    tree.insert(SYSTEM_A[:10], "r2")
    new = SYSTEM_B + [1]
    assert choose_prefix(tree, new, {"r0": 0, "r1": 1, "r2": 0})[0] == ["r1", "r2", "r0"]
    assert choose_prefix(tree, new, {"r0": 0, "r1": 0, "r2": 0})[0][0] == "r1"
    tree.insert(SYSTEM_B, "r1")  # r1 holds 100 tokens, as r0; r2 10
    assert choose_prefix(tree, [7] + SYSTEM_A, {"r0": 0, "r1": 0, "r2": 2})[0][0] == "r2"
    assert choose_prefix(tree, [7] + SYSTEM_A, {"r0": 1, "r1": 0, "r2": 0})[0][:2] == ["r2", "r1"]
    # a match under min_match of the prompt is no match: [100] of 101 shared is 1 %
    assert choose_prefix(tree, [100] + SYSTEM_B, {"r0": 0, "r1": 0}, min_match=0.1)[1] == 0


def test_a_full_replica_forgets_its_least_recently_used_branch() -> None:
    tree = PrefixTree(max_tokens=10)
    shared = [1, 2, 3, 4, 5, 6]
    tree.insert(shared + [7, 8], "r0")
    tree.insert(shared + [9, 10], "r0")
    tree.insert([50, 51, 52], "r1")  # another replica's share is its own
    assert tree.sizes["r0"] == 10
    tree.insert(shared + [11, 12], "r0")  # 12 tokens: [7, 8] goes, the oldest leaf
    assert tree.sizes["r0"] == 10
    assert tree.match(shared + [7, 8], ["r0"]) == (6, ["r0"])
    assert tree.match(shared + [9, 10], ["r0"]) == (8, ["r0"])
    tree.insert(list(range(20, 30)), "r0")  # 10 new tokens: all the old ones go
    assert tree.sizes["r0"] == 10
    assert tree.match(shared, ["r0"]) == (0, [])
    assert tree.match([50, 51, 52], ["r1"]) == (3, ["r1"])


def test_a_removed_replica_holds_nothing_and_the_others_keep_theirs() -> None:
    tree = PrefixTree()
    tree.insert(SYSTEM_A, "r0")
    tree.insert(SYSTEM_A[:50], "r1")
    tree.remove("r0")
    assert tree.tenants() == {"r1"}
    assert tree.match(SYSTEM_A, ["r0", "r1"]) == (50, ["r1"])
    assert "r0" not in tree.sizes


def test_one_busy_replica_does_not_turn_the_others_to_least_loaded() -> None:
    """Load decides when the target itself is loaded beyond the least loaded, not when
    any replica is (with 64 replicas one is nearly always busy)."""
    tree = PrefixTree()
    tree.insert(SYSTEM_A + [1], "r0")
    tree.insert(SYSTEM_B + [2], "r1")
    loads = {"r0": 1, "r1": 9, "r2": 0}
    order, matched, by_load, _ = choose_prefix(tree, SYSTEM_A + [3], loads, imbalance=4)
    assert (order, matched, by_load) == (["r0", "r2", "r1"], 100, False)
    order, matched, by_load, _ = choose_prefix(tree, SYSTEM_B + [3], loads, imbalance=4)
    assert (order, matched, by_load) == (["r2", "r0", "r1"], 0, True)


def test_pow2_and_round_robin() -> None:
    loads = {"r0": 3, "r1": 1, "r2": 2}
    for seed in range(10):
        two = choose_pow2(loads, random.Random(seed))
        assert len(set(two)) == 2 and loads[two[0]] <= loads[two[1]]
    assert choose_round_robin(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert choose_round_robin([], 3) == []
    router = Router("round-robin")
    firsts = [router.choose(["r1", "r0"], None)[0] for _ in range(4)]
    assert firsts == ["r0", "r1", "r0", "r1"]  # the ring in name order


def test_a_router_counts_in_flight_and_forgets_a_dead_replica() -> None:
    router = Router("prefix", imbalance=1)
    router.routed("r0", "a", SYSTEM_A)
    assert router.choose(["r0", "r1"], SYSTEM_A + [1]) == ["r0", "r1"]
    router.routed("r0", "b", SYSTEM_A)  # r0 now 2 in flight, r1 0: past imbalance 1
    assert router.choose(["r0", "r1"], SYSTEM_A + [1]) == ["r1", "r0"]
    assert router.stats.load_fallbacks == 1
    assert (router.stats.prompt_tokens, router.stats.matched_tokens) == (200, 100)
    router.completed("r0", "a")
    assert router.loads(["r0", "r1"]) == {"r0": 1, "r1": 0}
    router.forget("r0")
    assert router.tree.tenants() == set() and router.loads(["r0"]) == {"r0": 0}
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        Router("fastest")


def test_replicas_without_ray_is_one_error_line(smollm2_gguf: Path) -> None:
    code = (
        "import runpy, sys; sys.modules['ray'] = None; "  # import ray: ImportError
        f"sys.argv = ['dynalm', 'serve', {str(smollm2_gguf)!r}, '--replicas', '2']; "
        "runpy.run_module('dynalm.cli', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: --replicas needs Ray Serve, which is not installed")
    assert "pip install 'dynalm[cluster]'" in lines[0]


@pytest.mark.parametrize("bad", [0, -1])
def test_a_tree_needs_room(bad: int) -> None:
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        PrefixTree(bad)


def test_traffic_counts_the_requests_through_each_prefix_decayed() -> None:
    """Each node counts the inserts through it, decayed by 1 - 1/window an insert: with a
    window of 2, ticks 1, 2, 3 weigh 1/4, 1/2, 1 at tick 3."""
    tree = PrefixTree(window=2)
    tree.insert(SYSTEM_A + [1], "r0")
    tree.insert(SYSTEM_A + [2], "r1")  # splits r0's edge after SYSTEM_A: both counted there
    tree.insert(SYSTEM_B + [3], "r0")
    total, path = tree.traffic(SYSTEM_A + [9], ["r0", "r1"], min_depth=10)
    assert total == pytest.approx(0.25 + 0.5 + 1)
    assert len(path) == 1  # SYSTEM_A's node; [9] is no node
    depth, requests, holders = path[0]
    assert (depth, sorted(holders)) == (100, ["r0", "r1"])
    assert requests == pytest.approx(0.25 + 0.5)
    assert tree.traffic(SYSTEM_A + [1], ["r1"], min_depth=101)[1] == [(101, 0.25, [])]
    assert tree.traffic(SYSTEM_A, ["r0"], min_depth=101)[1] == []  # too shallow
    with pytest.raises(ValueError, match="window must be positive"):
        PrefixTree(window=0)


def route(router: Router, replicas: list[str], prompts: list[list[int]]) -> Counter:
    """Each prompt in turn, completed before the next arrives (loads stay 0: the load test
    never fires); the requests each replica got."""
    got: Counter = Counter()
    for i, prompt in enumerate(prompts):
        first = router.choose(replicas, prompt)[0]
        router.routed(first, f"q{i}", prompt)
        router.completed(first, f"q{i}")
        got[first] += 1
    return got


def test_a_hot_prefix_gets_a_second_holder_and_its_traffic_splits() -> None:
    """One system prompt with 80 % of the requests on 2 replicas: its holder's fair share
    is 50 %, so once the share is sure (Wilson's bound at 2 sigma, ~12 requests) the next
    goes to the other replica, which holds it after; the two then alternate on it. The
    cold prompts stay where they were sent first."""
    router, replicas = Router("prefix"), ["r0", "r1"]
    cold = [list(range(1000 * k, 1000 * k + 100)) for k in range(1, 3)]  # 10 % each
    prompts = []
    for i in range(100):
        system = cold[i % 10 // 5] if i % 10 in (3, 7) else SYSTEM_A
        prompts.append([*system, 5000 + i])
    got = route(router, replicas, prompts)
    assert router.stats.hot_spreads == 1 and router.stats.load_fallbacks == 0
    assert sorted(router.tree.match(SYSTEM_A, replicas)[1]) == replicas  # held twice
    for system in cold:
        assert len(router.tree.match(system, replicas)[1]) == 1  # held once
    assert max(got.values()) <= 60, got  # 80 % on one replica without the spread


def test_prefixes_with_their_fair_share_are_never_spread() -> None:
    """4 system prompts evenly over 2 replicas (25 % each, under a holder's fair 50 %), and
    one prompt seen once or twice at the start (1 of 1 proves nothing): no spreads; every
    prompt on one replica."""
    router, replicas = Router("prefix"), ["r0", "r1"]
    systems = [list(range(1000 * k, 1000 * k + 100)) for k in range(4)]
    got = route(router, replicas, [[*systems[i % 4], 5000 + i] for i in range(200)])
    assert router.stats.hot_spreads == 0, got
    assert all(len(router.tree.match(s, replicas)[1]) == 1 for s in systems)
    fresh = Router("prefix")
    route(fresh, replicas, [[*SYSTEM_A, 1], [*SYSTEM_A, 2], [*SYSTEM_A, 3]])
    assert fresh.stats.hot_spreads == 0  # 3 of 3: Wilson's bound is 0.43 < 0.5


def test_holders_of_a_prefix_alternate_when_their_loads_tie() -> None:
    tree = PrefixTree()
    tree.insert(SYSTEM_A + [1], "r0")
    tree.insert(SYSTEM_A + [2], "r1")  # r1 sent a request last: r0 goes first
    order, _, _, _ = choose_prefix(tree, SYSTEM_A + [3], {"r0": 0, "r1": 0}, hot=1e9)
    assert order == ["r0", "r1"]
    tree.insert(SYSTEM_A + [3], "r0")
    order, _, _, _ = choose_prefix(tree, SYSTEM_A + [4], {"r0": 0, "r1": 0}, hot=1e9)
    assert order == ["r1", "r0"]
    order, _, _, _ = choose_prefix(tree, SYSTEM_A + [4], {"r0": 0, "r1": 1}, hot=1e9)
    assert order == ["r0", "r1"]  # load first
