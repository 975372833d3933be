"""Placement rules: soft placement, explicit devices, validation."""
import pytest

from towers.errors import UserError
from towers.devices.placement import CPU, Device, resolve


def test_no_gpu_soft_places_towers_on_cpu_with_a_notice():
    p = resolve(2, None, soft=True, gpu_count=0)
    assert p.towers == [CPU, CPU]
    assert "no CUDA device" in p.notice and "2 towers on the CPU" in p.notice
    assert p.reducer_description().startswith("on-device mean on cpu")


def test_no_gpu_without_soft_placement_says_what_was_asked_and_what_exists():
    with pytest.raises(UserError) as e:
        resolve(2, None, soft=False, gpu_count=0)
    msg = str(e.value)
    assert "2 GPU towers" in msg and "no CUDA device" in msg and "devices cpu" in msg and "soft_placement=True" in msg


def test_fewer_gpus_than_towers_share_round_robin():
    p = resolve(5, None, soft=True, gpu_count=2)
    assert [str(d) for d in p.towers] == ["gpu:0", "gpu:1", "gpu:0", "gpu:1", "gpu:0"]
    assert p.groups == [[0, 2, 4], [1, 3]]
    assert p.gpus == [Device("gpu", 0), Device("gpu", 1)]
    assert "share 2 GPUs" in p.notice
    assert "NCCL" in p.reducer_description() and "share a GPU" in p.reducer_description()


def test_fewer_gpus_than_towers_is_an_error_without_soft_placement():
    with pytest.raises(UserError, match=r"4 towers.*only 2 CUDA devices"):
        resolve(4, None, soft=False, gpu_count=2)


def test_enough_gpus_one_tower_each():
    p = resolve(2, None, gpu_count=4)
    assert [str(d) for d in p.towers] == ["gpu:0", "gpu:1"] and p.notice is None
    assert p.reducer_description() == "NCCL all-reduce (avg, float32) over gpu:0, gpu:1"


def test_explicit_devices():
    p = resolve(None, "0,2", gpu_count=3)
    assert [str(d) for d in p.towers] == ["gpu:0", "gpu:2"]
    p = resolve(4, "1,2", gpu_count=3)
    assert [str(d) for d in p.towers] == ["gpu:1", "gpu:2", "gpu:1", "gpu:2"]


def test_devices_cpu_forces_cpu_even_with_gpus():
    p = resolve(3, "cpu", gpu_count=8)
    assert p.towers == [CPU] * 3 and p.notice is None


@pytest.mark.parametrize(
    "devices, count, pattern",
    [
        ("0,0", 2, "names GPU 0 twice"),
        ("1,3", 2, "GPU 3 does not exist"),
        ("9", 0, "GPU 9 does not exist: no CUDA device is visible"),  # before any fallback to the CPU
        ("0", 0, "GPU 0 does not exist"),
        ("a,b", 2, "not understood"),
        ("-1", 2, "non-negative"),
    ],
)
def test_devices_are_validated(devices, count, pattern):
    with pytest.raises(UserError, match=pattern):
        resolve(None, devices, gpu_count=count)


def test_fewer_towers_than_named_devices_is_an_error():
    with pytest.raises(UserError, match="fewer than the 2 GPUs"):
        resolve(1, "0,1", gpu_count=2)


def test_placement_table_names_every_role():
    table = resolve(3, None, gpu_count=2).table()
    for text in ("tower 0", "tower 2", "gpu:0", "EMA", "input parsing", "cpu (background thread)", "reducer", "NCCL"):
        assert text in table


def test_a_machine_without_the_nvidia_driver_counts_no_gpu_without_importing_cupy():
    """Before: every command imported CuPy to count GPUs, a second of CPU on each start without a GPU."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from towers.devices.placement import cuda_driver_absent

    if not cuda_driver_absent():
        pytest.skip("the NVIDIA driver library is here: counting GPUs asks CuPy")
    code = ("import sys; from towers.devices.placement import cuda_device_count; "
            "print(cuda_device_count(), 'cupy' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["0", "False"], p.stderr
