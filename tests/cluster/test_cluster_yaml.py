"""ray-cluster.yaml: valid for Ray's cluster launcher (its JSON schema and validate_config),
with the node types, resources and setup steps Voodoo needs."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("jsonschema")

CONFIG = Path(__file__).resolve().parents[2] / "ray-cluster.yaml"


@pytest.fixture(scope="module")
def config():
    return yaml.safe_load(CONFIG.read_text())


def test_matches_rays_schema(config):
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config
    schema = json.loads((Path(os.path.dirname(ray.autoscaler.__file__)) /
                         "ray-schema.json").read_text())
    jsonschema.validate(config, schema)  # the file as written
    validate_config(prepare_config(copy.deepcopy(config)))  # as `ray up` sees it


def test_rejects_unknown_keys(config):
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config
    bad = copy.deepcopy(config)
    bad["setup_comands"] = ["typo"]
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))


def test_node_types_and_setup(config):
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("quant", 0) > 0 and "GPU" not in head["resources"]
    gpu = [t for t in types.values() if t["resources"].get("GPU", 0) > 0]
    assert gpu and all("quant" not in t["resources"] for t in gpu)
    setup = " ".join(config["setup_commands"])
    assert "pip install -e" in setup and "voodoo bootstrap" in setup
    assert config["file_mounts"] and config["head_start_ray_commands"]
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])
