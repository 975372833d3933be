"""The final evaluation is seen and counted: a bar on a terminal (nothing in redirected output), its time on
the test accuracy line, and the done line's time is the whole run's (towers/run/extensions.py, ``Run._finish``)."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time

import numpy as np

from tests.conftest import REPO
from towers import Config, Dataset, Trainer

DONE = re.compile(r"done: (\d+) steps \(to step \d+\) in ([\d.]+) s \(building ([\d.]+) s, training ([\d.]+) s, "
                  r"test evaluation ([\d.]+) s, writing ([\d.]+) s\); training ([\d.]+) examples/sec(?:, [\d.]+ per tower)? on ")


def slow_to_evaluate() -> Dataset:
    """A few training examples and a test set 200 times larger: the final evaluation outweighs 3 steps."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 64)).astype(np.float32)
    x_test = rng.standard_normal((60_000, 64)).astype(np.float32)
    return Dataset.from_arrays(x, rng.integers(0, 10, 300), x_test, rng.integers(0, 10, 60_000))


def test_the_done_line_counts_the_final_evaluation(tmp_path, capsys):
    cfg = Config(devices="cpu", n_gpu=2, batch_size=50, steps=3, hidden=1024, quiet=True, summary_every=0,
                 logdir=str(tmp_path / "run"))
    with Trainer(cfg, dataset=slow_to_evaluate()) as t:
        began = time.perf_counter()
        result = t.fit()
        fit_wall = time.perf_counter() - began
    lines = capsys.readouterr().out.splitlines()
    done = DONE.match(lines[-1])
    assert done, lines[-1]
    steps, total, build, train, evaluation, write, rate = map(float, done.groups())
    # The line's figures are the result's, rounded; the parts make up the whole.
    assert (total, build, train, evaluation, write) == tuple(round(result[k], 1) for k in (
        "run_seconds", "build_seconds", "train_seconds", "eval_seconds", "write_seconds"))
    assert abs(result["build_seconds"] + result["train_seconds"] + result["eval_seconds"] + result["write_seconds"]
               - result["run_seconds"]) < 1e-9
    assert result["build_seconds"] == t.build_seconds > 0 and result["write_seconds"] >= 0
    # The evaluation is part of the run's time: what fit() took and the line does not count is less than it
    # (before, the line's time was the training loop's alone, and the evaluation all of the rest).
    assert result["eval_seconds"] > result["train_seconds"]  # this test set is made slow to evaluate
    assert fit_wall - (result["run_seconds"] - result["build_seconds"]) < result["eval_seconds"] / 10
    # examples/sec stays a training figure: the steps' examples over the training time
    assert rate == round(3 * 100 / result["train_seconds"], 1) == round(result["examples_per_sec"], 1)
    accuracy = [ln for ln in lines if ln.startswith("test accuracy: ")]
    assert len(accuracy) == 1 and accuracy[0].endswith(f"on 60000 test examples, evaluated in {evaluation:.1f} s")


def npz_with_a_large_test_set(path) -> str:
    ds = slow_to_evaluate()
    np.savez(path, x=ds.x, y=ds.y, x_test=ds.x_test[:20_000], y_test=ds.y_test[:20_000])
    return str(path)


def train(args, stderr):
    """The command line with stdout piped and stderr as given (a pipe, or a terminal)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="100")
    return subprocess.Popen([sys.executable, "-m", "towers.train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=stderr)


def test_a_terminal_gets_the_evaluation_bar_and_redirected_output_no_bar(tmp_path):
    data = npz_with_a_large_test_set(tmp_path / "d.npz")
    common = ["--data", data, "--n-gpu", "2", "--batch-size", "50", "--steps", "3", "--hidden", "256",
              "--summary-every", "0"]
    # Redirected (pipes): the lines and nothing of a bar, neither the training's nor the evaluation's.
    p = train([*common, "--logdir", str(tmp_path / "piped")], subprocess.PIPE)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    both = out + err
    assert b"\r" not in both and b"\x1b[" not in both and b"%|" not in both and b"test evaluation:" not in both
    assert b"test accuracy: " in out and b"done: 3 steps" in out
    # A terminal on stderr: the training bar, then the evaluation's, counting both passes' examples.
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a new terminal is 0 x 0
    try:
        p = train([*common, "--logdir", str(tmp_path / "tty")], slave)
        os.close(slave)
        seen = bytearray()

        def read():
            while True:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the terminal's other end closed: the run is over
                    return
                if not chunk:
                    return
                seen.extend(chunk)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        out, _ = p.communicate(timeout=300)
        reader.join(timeout=30)
    finally:
        os.close(master)
    assert p.returncode == 0, bytes(seen)
    assert b"test evaluation:" in seen and b"/40000" in seen, bytes(seen)  # 2 x 20,000 test examples
    assert b"3/3" in seen  # the training bar, finished
    assert b"test evaluation:" not in out and b"done: 3 steps" in out
