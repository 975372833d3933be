"""``epochs``: the step count from the training set's size and the examples of a step (towers/config.py,
``steps_of_epochs``), the same run as the steps it gives."""
from __future__ import annotations

import numpy as np
import pytest

from towers import Config, Trainer, UserError
from towers.data.batches import Sampler
from towers.data.dataset import Dataset
from towers.output.checkpoint import load_checkpoint
from towers.train import main

SMALL = ["--n-gpu", "2", "--hidden", "16", "--batch-size", "70", "--quiet", "--summary-every", "0"]


def data(n: int) -> Dataset:
    rng = np.random.default_rng(0)
    return Dataset.from_arrays(rng.standard_normal((n, 4)).astype(np.float32), rng.integers(0, 3, n))


@pytest.mark.parametrize("n, towers, batch, accumulate, epochs, steps", [
    (1000, 1, 100, 1, 2, 20),  # the global batch divides the set: whole epochs, nothing over
    (1000, 1, 30, 1, 1, 34),  # 1000 / 30 = 33.3, rounded up
    (1000, 1, 50, 3, 2, 14),  # accumulate: a step takes 1 x 50 x 3 = 150 examples; 2000 / 150 = 13.3
    (1000, 3, 40, 1, 3, 25),  # 3 towers x 40 = 120; 3000 / 120 = 25
    (1000, 2, 30, 2, 5, 42),  # 2 towers x 30 x 2 = 120; 5000 / 120 = 41.7
    (1438, 2, 100, 1, 3, 22),  # the digits' size, the default job's batch: 4314 / 200 = 21.6
])
def test_epochs_give_the_step_count_rounded_up(n, towers, batch, accumulate, epochs, steps):
    cfg = Config(n_gpu=towers, devices="cpu", batch_size=batch, accumulate=accumulate, epochs=epochs, hidden=8)
    assert cfg.resolved().steps is None  # known once the data and the towers are
    with Trainer(cfg, dataset=data(n)) as t:
        assert (t.cfg.steps, t.cfg.epochs) == (steps, epochs)
        per_step = t.examples_per_step
    assert per_step == towers * batch * accumulate
    # After them every example was seen `epochs` times; the last step took fewer than one step's examples
    # from the next epoch, and one step fewer would leave the last epoch short.
    epoch, index = Sampler(n, per_step).at(steps)
    assert epoch == epochs and index < per_step
    assert Sampler(n, per_step).at(steps - 1) < (epochs, 0)


def test_a_run_of_epochs_is_the_run_of_the_steps_they_give(tmp_path, capsys):
    # The cosine schedule ends at the run's step count: it must be the derived one from the first step.
    common = [*SMALL, "--lr-schedule", "cosine", "--checkpoint-every", "5"]
    assert main([*common, "--epochs", "2", "--logdir", str(tmp_path / "epochs")]) == 0
    out = capsys.readouterr().out
    # 2 x 1438 examples / (2 towers x 70) = 20.5: 21 steps
    assert out.startswith("settings: ") and ", epochs 2 = steps 21, " in out.splitlines()[0], out
    assert "done: 21 steps (to step 21)" in out
    assert main([*common, "--steps", "21", "--logdir", str(tmp_path / "steps")]) == 0
    assert (tmp_path / "epochs" / "final.npz").read_bytes() == (tmp_path / "steps" / "final.npz").read_bytes()
    config = load_checkpoint(str(tmp_path / "epochs" / "ckpt-00000021.npz"))["config"]
    assert (config["steps"], config["epochs"]) == (21, 2)


def test_epochs_are_a_total_on_resume(tmp_path, capsys):
    common = [*SMALL, "--momentum", "0.9", "--checkpoint-every", "4"]
    assert main([*common, "--epochs", "2", "--logdir", str(tmp_path / "whole")]) == 0
    assert main([*common, "--epochs", "1", "--logdir", str(tmp_path / "split")]) == 0  # 11 steps
    assert main([*common, "--epochs", "2", "--resume", "--logdir", str(tmp_path / "split")]) == 0
    out = capsys.readouterr().out
    assert "ckpt-00000011.npz" in out and "done: 10 steps (to step 21)" in out, out
    assert (tmp_path / "whole" / "final.npz").read_bytes() == (tmp_path / "split" / "final.npz").read_bytes()


def test_steps_and_epochs_together_are_one_line(tmp_path, capsys):
    assert main(["--steps", "5", "--epochs", "1", "--logdir", str(tmp_path / "both")]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("towers.train: error: --steps 5 and --epochs 1 are both given: give one of them "
                            "(--epochs sets the step count from the training set's size and the examples of a step)\n")
    assert not (tmp_path / "both").exists()
    with pytest.raises(UserError, match="steps 5 and epochs 1 are both given"):
        Config(steps=5, epochs=1).resolved()
    assert Config().resolved().steps == 2000  # neither: the default


def test_the_one_tower_scaling_run_of_an_epochs_run_keeps_its_steps(tmp_path, capsys):
    # --measure-scaling builds a one-tower trainer from the run's settings, which then hold both.
    assert main([*SMALL, "--epochs", "1", "--measure-scaling", "--logdir", str(tmp_path / "s")]) == 0
    assert "scaling efficiency" in capsys.readouterr().out


def test_a_checkpoint_of_an_epochs_run_fills_a_newer_setting_from_its_own():
    import dataclasses

    from towers.config import checkpoint_settings, steps_of_epochs

    # A checkpoint holds both (the steps its epochs gave); a setting it lacks is resolved from its settings.
    old = dataclasses.asdict(steps_of_epochs(Config(model="resnet20", epochs=2).resolved(), 1000, 100))
    assert (old["steps"], old["epochs"]) == (20, 2)
    del old["lr_boundaries"]
    assert checkpoint_settings(old)["lr_boundaries"] == "32000,48000"
