"""Cluster descriptions: presets, files, and one-line errors."""

import json

import pytest

from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.efficiency import EfficiencyCurve, layer_work
from megatron_2bw.planner.hardware import GiB, cluster_presets, load_cluster


def test_presets_cover_the_paper_and_modern_servers():
    names = cluster_presets()
    for name in ("aws-p3.16xlarge", "dgx-a100-80gb", "dgx-h100", "dgx-h200"):
        assert name in names
        c = load_cluster(name)
        assert c.devices_per_server == 8
        assert 0 < c.usable_memory_bytes < c.device_memory_bytes


def test_paper_cluster_values():
    c = load_cluster("aws-p3.16xlarge")
    assert c.inter_server_bandwidth == pytest.approx(25e9 / 8)  # 25 Gbit/s per server
    assert 15 * GiB < c.device_memory_bytes <= 16 * GiB         # V100-16GB
    assert c.peak("fp16") == pytest.approx(125e12)
    assert c.intra_server_allreduce_bandwidth > 10 * c.inter_server_bandwidth  # NVLink >> Ethernet
    with pytest.raises(ConfigError, match="no bf16"):
        c.peak("bf16")
    assert load_cluster("dgx-h200").device_memory_bytes > load_cluster("dgx-h100").device_memory_bytes


def test_cluster_from_file(tmp_path):
    data = json.loads(load_cluster.__globals__["PRESET_DIR"].joinpath("aws-p3.16xlarge.json").read_text())
    data["name"], data["devices_per_server"] = "mine", 4
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    c = load_cluster(str(path))
    assert c.name == "mine" and c.devices_per_server == 4


@pytest.mark.parametrize("spec, match", [
    ("no-such-preset", "unknown --cluster preset"),
    ("/does/not/exist.json", "does not exist"),
])
def test_bad_cluster_is_one_line(spec, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_cluster(spec)
    assert "\n" not in str(e.value)


def test_bad_cluster_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        load_cluster(str(bad))
    bad.write_text(json.dumps({"name": "x", "peak_TFLOPs": {"fp16": 1},
                               "efficiency": {"max_fraction_of_peak": 0.5, "half_work_elements": 1}}))
    with pytest.raises(ConfigError, match="missing key 'device_memory_GiB'"):
        load_cluster(str(bad))


def test_efficiency_curve():
    e = EfficiencyCurve(0.4, 1e6)
    assert e.fraction(1e6) == pytest.approx(0.2)        # half of the maximum at half_work
    assert e.fraction(0) == 0.0
    assert e.fraction(1e9) == pytest.approx(0.4, rel=1e-2)
    fractions = [e.fraction(layer_work(b, 512, 2304, 1)) for b in (1, 2, 4, 8, 16)]
    assert fractions == sorted(fractions)                # rises with the microbatch
    assert layer_work(8, 512, 2304, 4) == layer_work(2, 512, 2304, 1)  # tensor parallelism thins the GEMMs
    with pytest.raises(ConfigError):
        EfficiencyCurve(1.5, 1.0)
