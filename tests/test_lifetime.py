"""No process-global state: a fit's model, shards and optimizer state die with their owners.

One 2-rank launch (``tests/scripts/lifetime_ranks.py``): fitted and dropped models are freed
(weakrefs dead, RSS flat over repeated fits), and a second strategy asking a live model for
another sharding gets a named error on every rank instead of silently keeping the old one. At
the launch's exit no process group's or store's thread is left to the finalising interpreter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import load_ranks, run_script

#: RSS may grow this much between the second and the last round (allocator caches, lazily
#: loaded modules); a leaked model of the test's size grows it by far more each round.
RSS_SLACK_MIB = 40


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lifetime")
    run_script("lifetime_ranks.py", str(out), timeout=600)
    return Path(out)


@pytest.fixture(scope="module")
def ranks(launch: Path) -> list[dict]:
    return load_ranks(launch, "lifetime")


def test_dropped_models_and_their_shards_are_freed(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["alive"] == [[False, False, False]] * len(r["alive"]), r["alive"]


def test_memory_does_not_grow_with_repeated_fits(ranks: list[dict]) -> None:
    for r in ranks:
        rss = r["rss"]
        print(f"rank {r['rank']} RSS per round (MiB): {[round(x) for x in rss]}")
        assert rss[-1] - rss[1] < RSS_SLACK_MIB, rss


def test_another_sharding_of_a_live_model_is_refused_by_name(ranks: list[dict]) -> None:
    for r in ranks:
        found = r["conflicts"]
        assert "constraints: different for table(s) ['t_cat_0'" in found["constraints"]
        assert "fused_params: different ['optimizer']" in found["fused_params"]
        assert found["same"] == 4 and found["lr only"] == 4
        assert r["fused_lr"] == [0.05] * len(r["fused_lr"])
        assert r["predicted"] == 1  # the predict after the fits ran (2 batches, 1 a rank)


def test_no_group_or_store_thread_is_left_to_the_interpreters_exit(launch: Path) -> None:
    # Left to the finalising interpreter, a gloo or store thread can abort the process
    # ("terminate called without an active exception"); the package's exit hook joins them.
    exits = load_ranks(launch, "exit")
    assert len(exits) == 2
    for r in exits:
        left = [t for t in r["threads"] if t.startswith(("pt_gloo", "gloo_", "pt_tcpstore"))]
        assert left == [], (r["rank"], r["threads"])
