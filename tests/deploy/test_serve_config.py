"""The Serve config for `serve run` and the container image definition agree with what they
deploy: Ray's own ServeDeploySchema, the app's argument checks, the pinned Ray version, and every
package the project installs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from svip_serve.app import build_app
from svip_serve.settings import ServeSettings

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]
SERVE_CONFIG = REPO / "deploy" / "serve-config.yaml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_serve_config_validates_against_rays_schema_and_builds_the_app():
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert config["http_options"]["host"] == "127.0.0.1"
    settings = ServeSettings.from_args(app["args"])
    module, attr = app["import_path"].split(":")
    assert (module, attr) == ("svip_serve.app", "build_app")
    assert isinstance(build_app(app["args"]), Application)
    assert sum(b["CPU"] for b in settings.bundles()) <= 2  # a replica fits a 2-core machine


def test_dockerfile_copies_every_package_and_pins_rays_version():
    text = DOCKERFILE.read_text()
    ray_pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray[serve]=="))
    version = ray_pin.split("==")[1]
    assert re.search(rf"^FROM rayproject/ray:{re.escape(version)}-py311-gpu$", text, re.M)
    assert (
        f'rayVersion: "{version}"' in (REPO / "deploy" / "helm" / "svip" / "templates" / "rayservice.yaml").read_text()
    )
    copied = re.findall(r"^COPY --chown=\S+ (.+) \S+$", text, re.M)
    sources = [s for line in copied for s in line.split()]
    for source in sources:
        assert (REPO / source).exists(), source
    package_dirs = PYPROJECT["tool"]["setuptools"]["package-dir"]
    for package in PYPROJECT["tool"]["setuptools"]["packages"]:
        top = package.split(".")[0]
        path = package_dirs.get(top, top)
        assert any(path.startswith(s.rstrip("/")) for s in sources), f"{package} ({path}) is not copied into the image"
