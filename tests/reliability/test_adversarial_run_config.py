"""What a run's parameters may do, and values that only failed once a pool was up.

A run started through a deployment (the UI form, ``prefect deployment run``, a schedule, a
trigger) executes with the worker's credentials: it may change what it trains and how it learns,
never endpoints, identities, credentials, the image or the worker's paths. A token pasted into a
value is refused and never repeated. Values that failed only after provisioning (an empty prefix
segment, a seed torch cannot take, a backoff of 1e308) fail at load, naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.config import ConfigError, load_config
from core.run_config import RunRequest, build_run_config
from tests.conftest import ROOT
from tests.reliability import report

LOCAL = "configs/local.yaml"
SAS = (
    "sv=2025-01-05&ss=b&srt=sco&sp=rwdlac&se=2030-01-01T00:00:00Z&sig=c2VjcmV0LXNpZ25hdHVyZQ%3D%3D"
)
SIGNATURE = "c2VjcmV0LXNpZ25hdHVyZQ"
ATTACKER = "https://collector.example.net"


def _deployed(overrides: list[str], **kwargs: Any) -> Any:
    """The config a run of retrain/manual (default config_path configs/local.yaml) gets."""
    kwargs.setdefault("config_path", LOCAL)
    request = RunRequest(overrides=tuple(overrides), **kwargs)
    return build_run_config(request, deployment_path=LOCAL, deployed=True)


# ------------------------------------------------------------------ what a run may change


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["data.connection_string_env=null", f"data.account_url={ATTACKER}"],
            "data.account_url, data.connection_string_env",
        ),
        ([f"output.account_url={ATTACKER}"], "output.account_url"),
        (["output.connection_string_env=OTHER_ACCOUNT"], "output.connection_string_env"),
        ([f"azure.batch_account_url={ATTACKER}"], "azure.batch_account_url"),
        (["image.registry=registry.example.net"], "image.registry"),
        (["image.repository=someone/else"], "image.repository"),
        ([f"output.links_url={ATTACKER}"], "output.links_url"),
        (["data.credentials_block=someone-elses"], "data.credentials_block"),
        (["share.account_key_secret=another-key"], "share.account_key_secret"),
        (
            ["azure.identity_client_id=00000000-0000-0000-0000-000000000000"],
            "azure.identity_client_id",
        ),
        (["output.container=another-pipelines-outputs"], "output.container"),
        (["work_dir=/etc/retrain"], "work_dir"),
        (["nfs.local_dir=/srv/another"], "nfs.local_dir"),
        (["pool.id=another-pool"], "pool.id"),
        (["pool.dedicated_nodes=50"], "pool.dedicated_nodes"),
        (["promotion.min_scored_fraction=0"], "promotion.min_scored_fraction"),
        (["validation.min_images_per_class=1"], "validation.min_images_per_class"),
    ],
)
def test_a_deployment_run_changes_no_endpoint_identity_credential_or_image(
    overrides: list[str], named: str
) -> None:
    """Before: overrides (or the form's config) set data.connection_string_env=null and
    data.account_url=<any host>, and the flow presented the worker's Azure token there."""
    with pytest.raises(ConfigError) as err:
        _deployed(overrides)
    message = str(err.value)
    assert f"it changed {named}" in message and "configs/local.yaml" in message, message
    assert ATTACKER not in message  # values are not repeated: one may be a token
    # The command line is its user's own: the same overrides load there.
    build_run_config(RunRequest(config_path=LOCAL, overrides=tuple(overrides)))
    report.record(
        "secrets",
        f"deployment run with overrides {', '.join(overrides)}",
        f"refused before anything is contacted, names {named}; the CLI still takes them",
    )


def test_the_run_form_config_may_differ_only_in_training_and_data() -> None:
    """The advanced form (the whole config) is checked against the deployment's config file: the
    same hole as overrides otherwise."""
    shipped = load_config(ROOT / LOCAL).model_dump(mode="json")
    form = {**shipped, "data": {**shipped["data"], "connection_string_env": None}}
    form["data"]["account_url"] = ATTACKER
    with pytest.raises(
        ConfigError, match=r"it changed data\.account_url, data\.connection_string_env"
    ):
        _deployed([], config=form, config_path=LOCAL)
    allowed = {
        **shipped,
        "training": {**shipped["training"], "epochs": 1, "lr": 0.01},
        "data": {**shipped["data"], "container": "landing", "prefix": "images", "version": "v2"},
    }
    chosen = _deployed([], config=allowed, config_path=LOCAL).config
    assert (chosen.training.epochs, chosen.data.dataset.prefix) == (1, "images/v2")
    report.record(
        "secrets",
        "deployment run: the form's advanced config with another data.account_url",
        "refused naming the fields; training and data root changes still run",
    )


def test_a_deployment_run_reads_only_the_projects_config_files(tmp_path: Path) -> None:
    elsewhere = tmp_path / "mine.yaml"
    elsewhere.write_text((ROOT / LOCAL).read_text().replace("retrain-outputs", "stolen"))
    with pytest.raises(ConfigError, match=r"configs/ folder on the worker"):
        _deployed([], config_path=str(elsewhere))
    with pytest.raises(ConfigError, match=r"configs/ folder on the worker"):
        _deployed([], config_path="configs/../tests/../../etc/passwd")
    # Another of the operator's files is fine (the README runs configs/azure.yaml this way).
    azure = _deployed([], config_path="configs/azure.example.yaml").config
    assert azure.target == "azure"
    report.record(
        "secrets",
        "deployment run with config_path outside configs/ (a file anyone could write)",
        "refused; the deployment's own file or another in configs/ is read",
    )


def test_what_a_run_may_change_still_runs() -> None:
    """The form's fields, the trigger's and learning settings through overrides."""
    config = _deployed(
        ["training.lr=0.01", "training.batch_size=32", "training.extra_args=[--fp16-allreduce]"],
        data_container="landing",
        data_prefix="images",
        epochs=2,
        model="resnet18",
        data_version="v3",
    ).config
    assert (config.training.lr, config.training.batch_size, config.training.epochs) == (
        0.01,
        32,
        2,
    )
    assert (config.data.container, config.data.dataset.prefix) == ("landing", "images/v3")


# ------------------------------------------------------------------ tokens in values


@pytest.mark.parametrize(
    "override",
    [
        f"output.account_url=https://acct.blob.core.windows.net/?{SAS}",
        f"data.account_url=https://acct.blob.core.windows.net?{SAS}",
        f"share.account_url=https://acct.file.core.windows.net/?{SAS}",
        f"azure.batch_account_url=https://b.westeurope.batch.azure.com/?{SAS}",
        f"image.registry=myregistry.azurecr.io?{SAS}",
        f"output.links_url=http://127.0.0.1:4280/?{SAS}",
        "data.account_url=https://user:c2VjcmV0LXNpZ25hdHVyZQ@acct.blob.core.windows.net",
        "data.connection_string_env=DefaultEndpointsProtocol=https;AccountName=a;"
        "AccountKey=c2VjcmV0LXNpZ25hdHVyZQ==",
    ],
)
def test_a_token_pasted_into_a_value_is_refused_and_not_repeated(override: str) -> None:
    """Before: --set output.account_url=...?sig=X left sig=X in the flow log, the run's
    parameters and the summary's From line. Every way a run loads its config refuses it, and
    the error (which becomes the run's state message) does not repeat it."""
    field = override.split("=", 1)[0]
    for attempt in (
        lambda: load_config(ROOT / LOCAL, [override]),
        lambda: build_run_config(RunRequest(config_path=LOCAL, overrides=(override,))),
    ):
        with pytest.raises(ConfigError) as err:
            attempt()
        message = str(err.value)
        assert field in message and SIGNATURE not in message, message
    report.record(
        "secrets", f"--set {field}=<a URL or string with a token>", "refused, not repeated"
    )


def test_the_source_line_hides_queries() -> None:
    """The run's source line (its log's `config: ...` and its summary's From line) never
    repeats a query, whatever field it was given for."""
    extra = f"training.extra_args=['--note=x?{SAS}']"
    source = build_run_config(RunRequest(config_path=LOCAL, overrides=(extra,))).source
    assert SIGNATURE not in source and "?REDACTED" in source
    report.record("secrets", "a query in an override's value", "the run's source line hides it")


# ------------------------------------------------------------------ values that failed late


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("data.prefix=images//v1", "data.prefix"),
        ("data.prefix=images/./v1", "data.prefix"),
        ("data.prefix=images\x00/v1", "data.prefix"),
        ("data.prefix=images\n/v1", "data.prefix"),
        ("output.prefix=runs//a", "output.prefix"),
        ("training.seed=18446744073709551616", "training.seed"),
        ("training.seed=-1", "training.seed"),
        ("retries.backoff_seconds=1e308", "retries.backoff_seconds"),
        ("retries.backoff_seconds=.inf", "retries.backoff_seconds"),
        ("output.links_url=http://127.0.0.1:4280/outputs", "output.links_url"),
    ],
)
def test_values_that_failed_after_provisioning_fail_at_load(override: str, named: str) -> None:
    """Before: images//v1 passed config and gate, then failed staging four times with the pool
    up; a seed >= 2**64 failed in torch; a backoff of 1e308 overflowed Prefect's retry; a
    links_url with a path made every link a 404."""
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / LOCAL, [override])
    assert f"  {named}:" in str(err.value), str(err.value)
    report.record("inputs", f"config --set {override!r}", f"refused at load, names {named}")


def test_a_trigger_prefix_with_an_empty_segment_is_refused_before_the_gate() -> None:
    with pytest.raises(ConfigError, match=r"data\.prefix"):
        _deployed([], data_container="landing", data_prefix="images//v1")


# ------------------------------------------------------------------ the attack, end to end

TOKEN = "eyJ0eXAiOiJKV1QiLCJzdGFuZC1pbiI6InRoZSB3b3JrZXIncyB0b2tlbiJ9"


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key: the other host speaks TLS, as Blob's SDK
    sends a bearer token over nothing else."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "host.pem", folder / "host.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


class _Recorder:
    """A small HTTP(S) server that records each request's path and Authorization header and
    answers with ``body`` (JSON)."""

    def __init__(
        self, body: dict[str, Any], status: int = 200, tls: tuple[Path, Path] | None = None
    ):
        import http.server
        import json
        import ssl
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append((self.command, self.path, self.headers.get("Authorization")))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_workers_token_goes_to_no_host_a_run_names(
    deployed: dict[str, Any], azurite: str, tmp_path: Path
) -> None:
    """Before: a run of retrain/manual with overrides data.connection_string_env=null and
    data.account_url=https://<another host> made the worker present its managed identity's
    token there. Here the worker has a managed identity (a stand-in of App Service's identity
    endpoint, which hands out a token) and the run names a TLS host of the test's own; the run
    is started by the deployment and executed as the process worker executes it."""
    import time

    from prefect.deployments import run_deployment

    from tests.conftest import child_env, prefect_api_env
    from tests.pipeline_helpers import execute_as_worker

    expires = int(time.time()) + 3600
    identity = _Recorder(
        {
            "access_token": TOKEN,
            "expires_on": str(expires),
            "resource": "https://storage.azure.com",
            "token_type": "Bearer",
        }
    )
    cert, key = _self_signed(tmp_path)
    other = _Recorder({"error": "denied"}, status=403, tls=(cert, key))
    try:
        run = run_deployment(
            "retrain/manual",
            parameters={
                "overrides": [
                    "data.connection_string_env=null",
                    f"data.account_url=https://127.0.0.1:{other.port}",
                ]
            },
            timeout=0,
        )
        env = {
            **child_env(),
            **prefect_api_env(),
            "AZURE_STORAGE_CONNECTION_STRING": azurite,
            "IDENTITY_ENDPOINT": f"http://127.0.0.1:{identity.port}/msi/token",
            "IDENTITY_HEADER": "stand-in-identity-header",
            "REQUESTS_CA_BUNDLE": str(cert),  # the other host is trusted: only the rule stops it
        }
        state, output = execute_as_worker(run, env)
    finally:
        identity.close()
        other.close()
    assert other.seen == [], f"the other host was sent {other.seen}"
    assert identity.seen == [], "the worker's identity was asked for a token"
    assert state.is_failed(), (state.message, output)
    assert "it changed data.account_url, data.connection_string_env" in str(state.message)
    report.record(
        "secrets",
        "retrain/manual run with overrides data.connection_string_env=null, "
        "data.account_url=<a TLS host of the test's>, the worker holding a managed identity",
        "run fails before any request, naming both fields; the host and the identity endpoint "
        "received nothing",
    )


def test_the_sensor_polls_only_the_projects_config_files(
    deployed: dict[str, Any], azurite: str, tmp_path: Path
) -> None:
    """The watch-new-data/poll deployment lists a data root with the worker's credentials: a
    run of it naming a config file of its own (another account, another root) is refused."""
    from prefect.deployments import run_deployment

    from tests.conftest import child_env, prefect_api_env
    from tests.pipeline_helpers import execute_as_worker

    elsewhere = tmp_path / "poll.yaml"
    elsewhere.write_text(
        (ROOT / LOCAL)
        .read_text()
        .replace(
            "connection_string_env: AZURE_STORAGE_CONNECTION_STRING",
            f"connection_string_env: null\n  account_url: {ATTACKER}",
            1,
        )
    )
    run = run_deployment(
        "watch-new-data/poll", parameters={"config_path": str(elsewhere)}, timeout=0
    )
    env = {**child_env(), **prefect_api_env(), "AZURE_STORAGE_CONNECTION_STRING": azurite}
    state, output = execute_as_worker(run, env)
    assert state.is_failed(), (state.message, output)
    assert "configs/ folder on the worker" in str(state.message)
    report.record(
        "secrets",
        "watch-new-data/poll run with a config_path of its own (another account URL)",
        "refused before listing anything",
    )
