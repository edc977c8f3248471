"""What `make service` starts, read from its component list (nothing is started): each
component's port option reaches its command and its status line, and the Azurite line says
exactly what it uploads."""

from __future__ import annotations

from pathlib import Path

import yaml

from deployments.service import Options, components
from deployments.supervisor import Component
from tests.conftest import ROOT


def _options(tmp_path: Path, config: str, **ports: int) -> Options:
    return Options(
        config,
        tmp_path / "state",
        ports.get("azurite", 10000),
        ports.get("prefect", 4200),
        "127.0.0.1",
        ports.get("relay", 8080),
        ports.get("gateway"),
    )


def _by_name(options: Options) -> dict[str, Component]:
    return {c.name: c for c in components(options)}


def test_each_port_option_reaches_its_component(tmp_path: Path) -> None:
    options = _options(
        tmp_path, "configs/local.yaml", azurite=10031, prefect=4231, relay=8031, gateway=4931
    )
    found = _by_name(options)
    for name, port in (("azurite", 10031), ("prefect", 4231), ("relay", 8031), ("gateway", 4931)):
        component = found[name]
        assert str(port) in component.command, (name, component.command)
        assert str(port) in component.where, (name, component.where)
    # Without the option the gateway listens where output.links_url says (loopback).
    default = _by_name(_options(tmp_path, "configs/local.yaml"))["gateway"]
    assert "4280" in default.where


def test_the_azurite_line_says_what_it_uploads_and_what_it_leaves(tmp_path: Path) -> None:
    shipped = _by_name(_options(tmp_path, "configs/local.yaml"))["azurite"]
    assert "the demo's digits uploaded to" in shipped.where
    assert "left as it is" not in shipped.where
    # A config of another data root: the demo's digits still go to the demo's root (the
    # command names no config), and the line says the config's root is left as it is.
    spec = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    spec["data"]["prefix"] = "textures"
    other = tmp_path / "textures.yaml"
    other.write_text(yaml.safe_dump(spec))
    azurite = _by_name(_options(tmp_path, str(other)))["azurite"]
    assert "--config" not in azurite.command
    assert "/textures left as it is" in azurite.where
    assert "the demo's digits uploaded to" in azurite.where
