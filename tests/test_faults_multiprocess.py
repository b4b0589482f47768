"""Faults with two real gloo ranks where only rank 1 misbehaves: every rank stops, promptly.

Launches of tests/scripts/faults_two_ranks.py: one where rank 1 gets SIGTERM (preemption), one
that resumes from that checkpoint and then runs the in-process faults (bad batch, NaN loss, NaN
weights at a save), one where rank 1 is SIGKILLed. Every
launch has a hard timeout, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_torchrec import is_sharded_checkpoint
from tests.helpers import ROOT, SCRIPTS, clean_env, load_ranks, run_script

SCRIPT = "faults_two_ranks.py"


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("faults")
    return out, _launch(out, "preempt")


@pytest.fixture(scope="module")
def phases(preempted: tuple[Path, Any]) -> Path:
    out = preempted[0]
    run_script(SCRIPT, str(out), "phases", timeout=240)  # resumes from the preemption first
    return out


@pytest.mark.parametrize(
    ("phase", "where", "stopped_at"),
    [
        # The default on 2 CPU ranks, pipelined: batch 2 travels during step 1, so it is checked
        # during step 0 (the vote ahead) and refused after it.
        ("bad_id", "batch 2 of the epoch (checked at step 1, before the pipeline", 1),
        # Unpipelined: checked during step 1, refused after it.
        ("bad_id_plain", "rank 1, step 2", 2),
    ],
)
def test_bad_batch_on_rank1_stops_both_ranks_before_the_step(
    phases: Path, phase: str, where: str, stopped_at: int
) -> None:
    r0, r1 = load_ranks(phases, phase)
    assert r0["error"] == r1["error"] == "BatchValidationError"
    for msg in (r0["message"], r1["message"]):
        assert where in msg and "'cat_0'" in msg and "'t_cat_0'" in msg
        assert "rank 1, " in msg and "id 27" in msg and "num_embeddings=20" in msg
    assert "another rank failed" in r0["message"]
    assert r0["global_step"] == r1["global_step"] == stopped_at  # the bad batch never ran
    # Decided after the last good step's checkpoint was written: that state is saved
    # (save_top_k=1 kept only it).
    folder = phases / f"{phase}_ckpts"
    ckpts = sorted(p.name for p in folder.iterdir())
    assert ckpts == [f"epoch=0-step={stopped_at}.ckpt"]
    assert is_sharded_checkpoint(folder / ckpts[0])


def test_a_bad_batch_judged_at_the_next_step_stops_both_ranks_before_any_save(
    phases: Path,
) -> None:
    # batch_checks="next_step" (CUDA's "auto"), through the device code on CPU tensors: rank 1's
    # batch of step 2 is checked on its device during step 2, which runs; the save after it
    # judges the verdict first (a collective), so every rank raises there and no checkpoint
    # holds that step's update.
    r0, r1 = load_ranks(phases, "bad_id_next")
    assert r0["error"] == r1["error"] == "BatchValidationError"
    for msg in (r0["message"], r1["message"]):
        assert "rank 1, step 2: feature 'cat_0'" in msg and "'t_cat_0'" in msg
        assert "id 27" in msg and "num_embeddings=20" in msg
    assert "another rank failed" in r0["message"]
    assert r0["global_step"] == r1["global_step"] == 3  # step 2 ran; step 3 never did
    folder = phases / "bad_id_next_ckpts"
    ckpts = sorted(p.name for p in folder.iterdir())
    assert ckpts == ["epoch=0-step=2.ckpt"]  # after steps 0 and 1: the last good state
    assert is_sharded_checkpoint(folder / ckpts[0])


def test_nan_loss_on_rank1_raises_on_both_ranks_naming_step_and_rank(phases: Path) -> None:
    r0, r1 = load_ranks(phases, "nan_raise")
    assert r0["error"] == r1["error"] == "NonFiniteLossError"
    assert "global step 3 on rank(s) [1]" in r0["message"]
    assert "this rank: nan" in r1["message"]


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step_without_a_broadcast(
    phases: Path,
) -> None:
    r0, r1 = load_ranks(phases, "sigterm_flag")
    # Lightning's own handling would broadcast rank 0's flag every step (missing rank 1's) and
    # stop rank 1 alone after its step; the flag rides in the strategy's step vote instead,
    # which runs during step 3 (where rank 1 got the flag) and stops both ranks after it.
    assert r0["error"] == r1["error"] == "SIGTERMException"
    assert r0["global_step"] == r1["global_step"] == 4  # step 3 ran on both, step 4 on neither
    assert r0["broadcasts"] == r1["broadcasts"] == 0
    # One vote per step, started during it: step 0's batch was voted on before its forward (no
    # step before it), every later batch during the step before it. The other vote that waits
    # is the sharding plan's, at setup.
    assert r0["votes_ahead"] == r1["votes_ahead"] == 4
    assert r0["votes_now"] == r1["votes_now"] == 2


def test_nan_weights_are_never_saved_and_the_previous_checkpoint_survives(phases: Path) -> None:
    r0, r1 = load_ranks(phases, "nan_ckpt")
    assert r0["error"] == r1["error"] == "NonFiniteCheckpointError"
    assert "rank(s) [1]" in r0["message"]
    assert "embedding_bags.t_cat_" in r1["message"]
    ckpts = sorted(p.name for p in (phases / "ckpts").iterdir())
    assert ckpts == ["epoch=0-step=2.ckpt"]
    assert is_sharded_checkpoint(phases / "ckpts" / ckpts[0])


def test_an_exception_checkpoint_after_the_backward_is_refused_on_every_rank(
    phases: Path,
) -> None:
    # It was written: the tables held step 3's update and the dense weights did not, and the
    # resume trained step 3's batch into the tables twice.
    for r in load_ranks(phases, "onexc_mid"):
        assert r["error"] == "MidStepCheckpointError"
        assert "refusing to save a checkpoint at global step 3" in r["message"]
    assert not (phases / "onexc_mid").exists()


def _launch(out: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / SCRIPT), str(out), mode],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,  # the strategy's collective timeout is 20 s: a hang fails here
    )


def test_killed_rank_makes_the_survivor_exit_with_a_peer_failure(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "kill")
    assert proc.returncode != 0
    assert "PeerFailureError" in proc.stderr and "another rank probably died" in proc.stderr
    (r0,) = [load_ranks(tmp_path, "kill", world=1)[0]]
    assert r0["error"] == "PeerFailureError"


@pytest.mark.parametrize(
    ("mode", "where", "message"),
    [
        ("raise_one", "global step 3 (train)", "a bug in rank 1's training_step at step 3"),
        # Rank 0 waited in Lightning's barrier after the setup hooks: a bare "Connection closed".
        ("raise_setup", "global step 0 (train)", "rank 1 fails at step 0"),
    ],
)
def test_a_users_error_on_one_rank_is_raised_by_type_on_the_other(
    tmp_path: Path, mode: str, where: str, message: str
) -> None:
    # Rank 0 raised a PeerFailureError that could only say "another rank probably died".
    proc = _launch(tmp_path, mode)
    assert proc.returncode != 0
    failed = torch.load(tmp_path / f"{mode}_rank1.pt", weights_only=False)
    assert failed["error"] == "Boom" and failed["boom"] and not failed["peer_failure"]
    peer = torch.load(tmp_path / f"{mode}_rank0.pt", weights_only=False)
    assert peer["error"] == "Boom" and peer["boom"] and peer["peer_failure"], peer
    told = f"stopped because another rank failed: rank 1 raised Boom at {where}: {message}"
    assert told in peer["message"]
    assert "[rank 0] Boom: stopped because another rank failed" in proc.stderr


def test_rank_zeros_own_error_reaches_the_others_though_its_store_dies_with_it(
    tmp_path: Path,
) -> None:
    # Lightning's launcher: rank 0 serves the store and its report died with it; rank 1 could
    # only say "another rank probably died".
    proc = _launch(tmp_path, "raise_zero")
    assert proc.returncode != 0
    failed = torch.load(tmp_path / "raise_zero_rank0.pt", weights_only=False)
    assert failed["error"] == "Boom" and not failed["peer_failure"]
    peer = torch.load(tmp_path / "raise_zero_rank1.pt", weights_only=False)
    assert peer["error"] == "Boom" and peer["boom"] and peer["peer_failure"], peer
    told = "stopped because another rank failed: rank 0 raised Boom at global step 3 (train)"
    assert told in peer["message"] and "rank 0 fails at step 3" in peer["message"]


def test_a_rank_stopping_alone_is_named_by_the_others(tmp_path: Path) -> None:
    # Not agreed (see docs/troubleshooting.md), but no longer "another rank probably died".
    proc = _launch(tmp_path, "stop_one")
    assert proc.returncode != 0
    stopped = torch.load(tmp_path / "stop_one_rank1.pt", weights_only=False)
    assert stopped["error"] is None and stopped["global_step"] == 3
    peer = torch.load(tmp_path / "stop_one_rank0.pt", weights_only=False)
    assert peer["error"] == "PeerFailureError", peer
    assert (
        "stopped because another rank stopped training alone: rank 1 stopped training at "
        "global step 3: trainer.should_stop was set on it"
    ) in peer["message"]


def test_ctrl_c_reaching_the_ranks_at_different_points_refuses_the_save_on_both(
    tmp_path: Path,
) -> None:
    # Rank 1 had started the next step's vote, rank 0 not: the save's broadcast paired with
    # that vote and both ranks hung until the collective timeout (30 minutes by default).
    started = time.monotonic()
    proc = _launch(tmp_path, "interrupt_apart")
    assert proc.returncode != 0
    assert time.monotonic() - started < 50  # not the meeting's minute either
    for rank in (0, 1):
        r = torch.load(tmp_path / f"interrupt_apart_final_rank{rank}.pt", weights_only=False)
        assert r["error"] == "MidStepCheckpointError", r
        assert "the ranks stopped at different points of a step" in r["message"]
        assert f"rank {rank}: refusing to save the checkpoint" in r["message"]
    assert not any((tmp_path / "interrupt_apart").glob("*"))


def test_sigterm_on_rank1_saves_a_complete_checkpoint_and_the_run_resumes(
    preempted: tuple[Path, Any], phases: Path
) -> None:
    out, proc = preempted
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Preempted (signal on rank(s) [1])" in proc.stdout + proc.stderr
    ckpt = out / "preempted.ckpt"
    assert is_sharded_checkpoint(ckpt) and len(list(ckpt.glob("*.distcp"))) == 2
    for r in load_ranks(phases, "resume"):
        assert r["error"] is None
        assert r["steps"] == [7, 8]  # saved after step 6, continues from there


def test_an_exception_checkpoint_of_one_failing_rank_ends_both_ranks_promptly(
    tmp_path: Path,
) -> None:
    # Rank 1 waited in the save's broadcast, rank 0 in step 3's all-to-all: both hung until the
    # collective timeout (30 minutes by default).
    started = time.monotonic()
    proc = _launch(tmp_path, "onexc_one")
    assert proc.returncode != 0
    assert time.monotonic() - started < 120
    failed = torch.load(tmp_path / "onexc_one_final_rank1.pt", weights_only=False)
    assert failed["error"] == "PeerFailureError"
    assert (
        "the checkpoint asked for while handling an exception was not written"
        in (failed["message"])
    )
    assert not any((tmp_path / "onexc_one").glob("*"))  # nothing, not even a partial save
    # The rank that did not fail says what the failed one raised, before its save was refused.
    peer = torch.load(tmp_path / "onexc_one_rank0.pt", weights_only=False)
    assert peer["error"] == "Boom" and peer["peer_failure"], peer
    assert (
        "rank 1 raised Boom at global step 3 (train): rank 1 fails at step 3" in (peer["message"])
    )
