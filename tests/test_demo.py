"""The demo (examples/digits.py): runs from the command line, and learns the digits."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
import digits as demo  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.mark.processes
@pytest.mark.timeout(180)
@pytest.mark.parametrize("loop,bar", [("fit", "Epoch 2/2"), ("custom", "epoch 2/2")])
def test_command_line_prints_the_report(loop, bar):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, "examples/digits.py", "--epochs=2", "--towers=2",
       "--reduction=naive", f"--loop={loop}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=150, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = proc.stdout
  assert "held-out accuracy" in report
  assert "examples/second" in report
  assert "mirrored, 2 towers" in report and "one device, no strategy" in report
  assert "naive all-reduce" in report
  assert ("model.fit" if loop == "fit" else "custom loop") in report
  assert bar in proc.stderr  # The progress bar (Keras's, or tqdm's), not in the report.
  assert bar not in report


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_four_towers_and_one_tower_learn_the_digits(loop):
  # conftest.py already split the CPU into 4 logical devices: the demo uses them.
  four = demo.train(demo.Config(towers=4, seed=1, epochs=12, loop=loop))
  one = demo.train(demo.Config(towers=1, seed=1, epochs=12, loop=loop))
  assert four["accuracy"] >= 0.95, four
  assert one["accuracy"] >= 0.95, one
  assert len(four["devices"]) == 4 and len(one["devices"]) == 1
  # Every copy of every weight, batch normalization's moving statistics included.
  assert four["copies"] == 4 and four["copies_max_difference"] == 0.0
  # Dropout draws other masks on 4 towers: the same training up to that noise.
  assert four["final_loss"] < 0.1 and one["final_loss"] < 0.1
  report = demo.format_report(demo.Config(towers=4, seed=1, loop=loop), four, one)
  assert "held-out accuracy" in report and "x the examples/second of one device" in report


def test_more_towers_than_devices_says_how_to_fix_it():
  with pytest.raises(ValueError, match=r"8 towers need 8 devices.*--towers=4 or fewer"):
    demo.train(demo.Config(towers=8, epochs=1))


def test_batch_larger_than_the_data_is_rejected():
  with pytest.raises(ValueError, match=r"--batch_size=5000 is larger than the 1437"):
    demo.train(demo.Config(towers=1, epochs=1, batch_size=5000))


@pytest.mark.processes
def test_ps_strategy_trains_on_a_local_cluster():
  """--strategy=ps: one PS process and one worker process running model.fit."""
  result = demo.train(demo.Config(strategy="ps", seed=1, epochs=12))
  assert result["strategy"] == "ParameterServerStrategy"
  assert result["label"] == "ps, 1 tower"
  assert result["accuracy"] >= 0.95


@pytest.mark.processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_multi_worker_strategy_trains_on_two_worker_processes(loop):
  """--strategy=multi_worker: 2 worker processes x 2 towers, synchronous."""
  result = demo.train(demo.Config(strategy="multi_worker", towers=4, seed=1, epochs=12,
                                  loop=loop))
  assert result["strategy"] == "MultiWorkerMirroredStrategy"
  assert result["label"] == "multi_worker, 4 towers" and result["workers"] == 2
  assert [d.split("/")[-1] for d in result["devices"]] == ["device:CPU:0", "device:CPU:1"]
  assert "across the worker processes" in result["reduction"]
  assert result["copies"] == 2 and result["copies_max_difference"] == 0.0
  assert result["accuracy"] >= 0.95 and result["final_loss"] < 0.1, result
  report = demo.format_report(demo.Config(strategy="multi_worker", loop=loop), result)
  assert "of each of 2 worker processes" in report


def test_multi_worker_towers_must_split_over_the_workers():
  with pytest.raises(ValueError, match=r"--towers must be a multiple of 2. Received: "
                                       r"--towers=3"):
    demo.train(demo.Config(strategy="multi_worker", towers=3, epochs=1))


def test_unknown_loop_is_rejected():
  with pytest.raises(ValueError, match=r"loop must be one of \('fit', 'custom'\). Received: "
                                       r"loop='keras'"):
    demo.train(demo.Config(towers=1, epochs=1, loop="keras"))


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_multi_worker_demo_under_the_launcher():
  """diststrat-run --workers 2 examples/digits.py --strategy=multi_worker: worker 0
  reports and compares with one device; worker 1 prints its accuracy."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
  env.pop("TF_CONFIG", None)
  proc = subprocess.run(
      [sys.executable, "-m", "diststrat.run", "--workers", "2", "examples/digits.py",
       "--strategy=multi_worker", "--epochs=12", "--seed=1"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=270, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  accuracy = [line for line in lines if line.startswith("[worker:0]   held-out accuracy")]
  assert accuracy, proc.stdout
  ours, one_device = (float(a.rstrip("%")) / 100 for a in accuracy[0].split()[-2:])
  assert ours >= 0.95 and one_device >= 0.95, accuracy
  assert "[worker:0]   strategy   MultiWorkerMirroredStrategy on CPU:0 of each of 2 worker " \
         "processes" in proc.stdout
  assert any(line.startswith("[worker:1] multi_worker, 2 towers: worker 1 done")
             for line in lines), proc.stdout
