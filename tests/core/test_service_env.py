"""Where the checkout's own commands find the service it runs (core/service_env.py): Prefect's
settings and the commands read the checkout's ``.env`` the service wrote; a ``.env`` of the
person's own, or none (another checkout), gives nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core.service_env import ENV_FILE, MARK, env_text, load_service_settings, written_by_service

SETTINGS = {
    "PREFECT_API_URL": "http://127.0.0.1:4321/api",
    "PREFECT_API_AUTH_STRING": "retrain:tok-en_1",
    "MLFLOW_TRACKING_USERNAME": "admin",
    "MLFLOW_TRACKING_PASSWORD": "pass-word_2",
    "AZURE_STORAGE_CONNECTION_STRING": "DefaultEndpointsProtocol=http;AccountKey=a+b/c==;",
}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the settings in the environment, and each put back as it was afterwards
    (load_service_settings writes os.environ itself)."""
    for name in SETTINGS:
        monkeypatch.setenv(name, "")  # recorded, so the test's own writes are undone too
        monkeypatch.delenv(name)


@pytest.mark.usefixtures("clean_env")
def test_prefect_and_the_commands_find_the_service_in_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prefect deployment run` typed in the checkout (Prefect reads its working folder's
    .env), and the checkout's commands (the rest of the file), reach the service."""
    from prefect.settings import Settings

    (tmp_path / ENV_FILE).write_text(env_text(SETTINGS, ".service"))
    assert written_by_service(tmp_path / ENV_FILE)
    monkeypatch.chdir(tmp_path)
    seen = Settings()
    assert str(seen.api.url) == SETTINGS["PREFECT_API_URL"]
    assert seen.api.auth_string is not None
    assert seen.api.auth_string.get_secret_value() == SETTINGS["PREFECT_API_AUTH_STRING"]
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "someone-else")  # the environment wins
    added = load_service_settings(tmp_path)
    assert set(added) == set(SETTINGS) - {"MLFLOW_TRACKING_USERNAME"}
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == SETTINGS["MLFLOW_TRACKING_PASSWORD"]
    assert (
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] == SETTINGS["AZURE_STORAGE_CONNECTION_STRING"]
    )
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "someone-else"


@pytest.mark.usefixtures("clean_env")
def test_another_checkout_or_a_persons_own_env_file_gives_nothing(tmp_path: Path) -> None:
    assert load_service_settings(tmp_path) == {}  # no .env: another checkout
    (tmp_path / ENV_FILE).write_text("MLFLOW_TRACKING_PASSWORD=mine\n")
    assert not written_by_service(tmp_path / ENV_FILE)
    assert load_service_settings(tmp_path) == {}
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ


def test_a_value_that_would_break_the_file_is_refused() -> None:
    with pytest.raises(ValueError, match="PREFECT_API_AUTH_STRING"):
        env_text({"PREFECT_API_AUTH_STRING": "it's"}, ".service")
    assert env_text({}, "x").startswith(MARK)
