"""Batch checks on a background thread (lightning_torchrec.check_ahead)."""

from __future__ import annotations

import threading

import pytest

from lightning_torchrec.check_ahead import LIMIT, CheckAhead


class Loader:
    """A minimal loader with an attribute Lightning might read."""

    sampler = "the sampler"

    def __init__(self, items: list[object]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.items)


def test_batches_are_checked_off_the_calling_thread_as_they_are_drawn() -> None:
    threads: list[str] = []

    def check(batch: object) -> str | None:
        threads.append(threading.current_thread().name)
        return "bad" if batch == "b" else None

    checks = CheckAhead(check)
    loader = checks.feed(Loader(["a", "b", "c"]))
    assert len(loader) == 3 and loader.sampler == "the sampler"
    drawn = list(loader)
    assert [checks.take(x) for x in drawn] == [(True, None), (True, "bad"), (True, None)]
    assert all(t.startswith("lightning_torchrec-checks") for t in threads)
    assert checks.take("a") == (False, None)  # taken once; an unknown batch is not a verdict
    checks.close()


def test_an_equal_but_different_batch_is_not_mistaken_for_a_checked_one() -> None:
    checks = CheckAhead(lambda b: None)
    checks.submit(drawn := [1, 2])
    assert checks.take([1, 2]) == (False, None)
    assert checks.take(drawn) == (True, None)
    checks.close()


def test_a_failing_check_raises_at_take_and_pending_checks_are_bounded() -> None:
    def check(batch: object) -> str | None:
        raise RuntimeError(f"check broke on {batch}")

    checks = CheckAhead(check)
    checks.submit(batch := object())
    with pytest.raises(RuntimeError, match="check broke"):
        checks.take(batch)
    kept = [object() for _ in range(LIMIT + 5)]
    good = CheckAhead(lambda b: None)
    for b in kept:
        good.submit(b)
    assert good.take(kept[0]) == (False, None)  # the oldest were dropped
    assert good.take(kept[-1]) == (True, None)
    checks.close()
    good.close()


def test_the_strategy_checks_training_batches_in_the_background() -> None:
    import lightning as L

    from lightning_torchrec import TorchRecStrategy
    from tests.scripts.factory import QUIET, table_wise, tiny_data, tiny_dlrm

    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False)
    threads: list[str] = []
    problem = strategy._guard.problem

    def spy(batch: object) -> str | None:
        threads.append(threading.current_thread().name)
        return problem(batch)

    strategy._guard.ahead._check = spy
    trainer = L.Trainer(strategy=strategy, devices=1, max_steps=4, limit_val_batches=0, **QUIET)
    trainer.fit(tiny_dlrm(), datamodule=tiny_data())
    assert len(threads) >= 4 and all(t.startswith("lightning_torchrec-checks") for t in threads)
