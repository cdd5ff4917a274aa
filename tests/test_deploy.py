"""The deploy files under deploy/: every metric the Grafana dashboard and the alert rules name
is in a real /metrics scrape; the Kubernetes manifests validate against the Kubernetes
schemas; the Dockerfile, the systemd unit and the configs keep their invariants.

No container engine runs here: the image itself is not built by these tests.
"""

from __future__ import annotations

import asyncio
import configparser
import io
import json
import re
import shlex
import time
from pathlib import Path
from typing import Any

import aiohttp
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from prometheus_client.parser import text_string_to_metric_families

from edgeproxy import load_config
from edgeproxy._cli import build_parser

from .conftest import FakeClock, ProxyFactory, RegionFactory

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
REPO = DEPLOY.parent
DASHBOARD = DEPLOY / "grafana" / "edgeproxy-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "edgeproxy-alerts.yaml"
SIDECAR = DEPLOY / "kubernetes" / "sidecar.yaml"
UNIT = DEPLOY / "systemd" / "edgeproxy.service"
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
CACHED = {**BODY, "temperature": 0}
# The first release with native sidecars (init containers with restartPolicy: Always), and the
# newest the validator ships.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
_METRIC = re.compile(r"\bedgeproxy_[a-z0-9_]+")
# What a sample's name adds to its family's, by the family's type.
_SUFFIXES = {
    "_bucket": ("histogram",),
    "_sum": ("histogram", "summary"),
    "_count": ("histogram", "summary"),
    "_total": ("counter",),
}


def dashboard_exprs() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in data["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    for variable in data["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def names_in(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in _METRIC.findall(expr)}


def scrape_names(text: str) -> tuple[set[str], dict[str, str]]:
    """(the sample names with at least one sample, each family's type by name)."""
    samples: set[str] = set()
    families: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family.type
        samples.update(sample.name for sample in family.samples)
    return samples, families


def missing_from(names: set[str], samples: set[str], families: dict[str, str]) -> set[str]:
    """The names a scrape has neither as samples nor as a declared family (a labelled family
    that has seen no traffic yet declares itself with no samples)."""
    missing = set()
    for name in names:
        if name in samples or name in families:
            continue
        found = False
        for suffix, kinds in _SUFFIXES.items():
            base = name.removesuffix(suffix)
            if base != name and families.get(base) in kinds:
                found = True
        if not found:
            missing.add(name)
    return missing


async def test_every_metric_in_the_dashboard_and_alerts_is_in_a_real_scrape(
    make_region: RegionFactory, make_proxy: ProxyFactory
) -> None:
    region = await make_region("ap-1")
    clock = FakeClock.following(time.time)
    routes = [{"name": "chat", "path": CHAT, "cache_ttl": 60, "stale_if_error": 3600}]
    proxy = await make_proxy([region], routes=routes, cache_clock=clock)
    async with aiohttp.ClientSession() as client:

        async def post(body: dict[str, Any]) -> tuple[int, dict[str, str]]:
            async with client.post(proxy.url + CHAT, json=body) as resp:
                await resp.read()
                return resp.status, dict(resp.headers)

        for body in (BODY, {**BODY, "stream": True}, CACHED):
            assert (await post(body))[0] == 200
        for _ in range(500):
            if proxy.status()["cache"]["stores"] == 1:
                break
            await asyncio.sleep(0.01)
        assert (await post(CACHED))[1]["X-Edgeproxy-Cache"] == "HIT"
        # No region left: a stale answer (degraded) and a 5xx for a request with none.
        await region.kill()
        clock.advance(120)
        status, headers = await post(CACHED)
        assert status == 200 and headers["X-Edgeproxy-Degraded"] == "stale-cache"
        assert (await post(BODY))[0] >= 500
        async with client.get(proxy.admin_url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()

    samples, families = scrape_names(text)
    dashboard = names_in(dashboard_exprs())
    alerts = names_in([rule["expr"] for rule in alert_rules()])
    assert len(dashboard) >= 20 and len(alerts) >= 8
    assert missing_from(dashboard, samples, families) == set()
    assert missing_from(alerts, samples, families) == set()
    # The check itself: a misspelt name, or a suffix its family's type cannot have, is caught.
    assert missing_from({"edgeproxy_region_upp", "edgeproxy_in_flight_bucket"}, samples, families)
    # The series the alerts are about had samples, not only a declaration.
    for name in (
        "edgeproxy_client_ttfb_seconds_bucket",
        "edgeproxy_request_duration_seconds_count",
        "edgeproxy_region_health_ejections_total",
        "edgeproxy_degraded_responses_total",
        "edgeproxy_fallback_local_model_answered_total",
        "edgeproxy_admission_shed_queue_full",
    ):
        assert name in samples, name


def test_alert_rules_cover_what_operators_page_on() -> None:
    rules = alert_rules()
    for rule in rules:
        assert set(rule) >= {"alert", "expr", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
    by_metric = {name: [r["alert"] for r in rules if name in r["expr"]] for name in _ALERTED}
    assert all(by_metric.values()), by_metric
    assert len({r["alert"] for r in rules}) == len(rules)


_ALERTED = (
    "edgeproxy_client_ttfb_seconds_bucket",  # p99 TTFB
    'status_class="5xx"',  # the error ratio
    "edgeproxy_region_health_ejections_total",  # ejections
    'reason="local-model"',  # local-model answers
    "edgeproxy_admission_shed_queue_full",  # queue shed
)


def test_dashboard_is_importable_grafana_json() -> None:
    data = json.loads(DASHBOARD.read_text())
    assert data["title"] and data["uid"] and data["schemaVersion"] >= 36
    ids = [panel["id"] for panel in data["panels"]]
    assert len(ids) == len(set(ids))
    for panel in data["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        for target in panel.get("targets", []):
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def sidecar_docs() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(SIDECAR.read_text()) if doc]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_validate_against_the_schemas(version: str) -> None:
    docs = sidecar_docs()
    assert [doc["kind"] for doc in docs] == ["ConfigMap", "Deployment"]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    # The validator is live: an unknown field and a wrong type are refused.
    deployment = docs[1]
    pod = deployment["spec"]["template"]["spec"]
    typo = {**pod, "initContainers": [{**pod["initContainers"][0], "restartPolicyy": "Always"}]}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {**deployment, "spec": {**deployment["spec"], "template": {"spec": typo}}},
            version,
            strict=True,
        )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {**deployment, "spec": {**deployment["spec"], "replicas": "two"}}, version, strict=True
        )


def test_kubernetes_sidecar_probes_the_admin_listener_of_its_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_map, deployment = sidecar_docs()
    path = tmp_path / "edge.toml"
    path.write_text(config_map["data"]["edge.toml"])
    monkeypatch.setenv("EDGEPROXY_ADMIN_TOKEN", "t")
    config = load_config(path)
    pod = deployment["spec"]["template"]["spec"]
    (proxy,) = [c for c in pod["initContainers"] if c["name"] == "edgeproxy"]
    assert proxy["restartPolicy"] == "Always"  # a native sidecar
    assert [c["name"] for c in pod["containers"]] == ["app"]
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    assert ports["admin"] == config.admin.port
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    # Probes come from outside the pod: the admin listener binds every address, with a token
    # (which the config requires then), from the Secret, in the variable the CLI reads too.
    assert config.admin.host == "0.0.0.0" and config.admin.token_env == "EDGEPROXY_ADMIN_TOKEN"
    env = {e["name"] for e in proxy["env"]}
    assert config.admin.token_env in env
    assert {r.api_key_env for r in config.regions} <= env
    # The config the container reads is the ConfigMap's.
    args = build_parser().parse_args(proxy["args"])
    mount = next(m for m in proxy["volumeMounts"] if m["name"] == "config")
    assert Path(args.config).parent == Path(mount["mountPath"])
    assert pod["terminationGracePeriodSeconds"] > config.server.grace_period
    app_env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert app_env["OPENAI_BASE_URL"] == f"http://127.0.0.1:{config.server.port}/v1"


def dockerfile() -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO((DEPLOY / "Dockerfile").read_bytes()))


def test_dockerfile_invariants(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = dockerfile()
    steps = parser.structure
    froms = [s["value"] for s in steps if s["instruction"] == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build") and froms[1].endswith(" AS runtime")
    # The local extra behind a build argument, declared in both stages that read it.
    stage_of = []
    stage = -1
    for step in steps:
        stage += step["instruction"] == "FROM"
        stage_of.append(stage)
    args = [(stage_of[i], s["value"]) for i, s in enumerate(steps) if s["instruction"] == "ARG"]
    assert (0, "WITH_LOCAL=false") in args and (1, "WITH_LOCAL=false") in args
    runs = " ".join(s["value"] for s in steps if s["instruction"] == "RUN")
    assert 'extras="[local]"' in runs and '.${extras}"' in runs
    # Runs as a non-root user, the last USER of the final stage.
    users = [s["value"] for i, s in enumerate(steps) if s["instruction"] == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert stage_of[steps.index(next(s for s in steps if s["instruction"] == "USER"))] == 1
    # The image's config, its admin port in the health check, its ports exposed.
    monkeypatch.setenv("EDGEPROXY_ADMIN_TOKEN", "t")
    config = load_config(DEPLOY / "edge.toml")
    (check,) = [s["value"] for s in steps if s["instruction"] == "HEALTHCHECK"]
    assert f"http://127.0.0.1:{config.admin.port}/healthz" in check and "CMD" in check
    exposed = {int(p) for s in steps if s["instruction"] == "EXPOSE" for p in s["value"].split()}
    assert exposed == {config.server.port, config.admin.port}
    assert config.server.workers == "auto"
    # What it copies from the build context exists, and the ignore file lets it through.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    for step in steps:
        if step["instruction"] == "COPY" and not step["value"].startswith("--from"):
            *sources, _ = step["value"].split()
            for source in sources:
                assert (REPO / source).exists(), source
                assert f"!{source}" in ignore or f"!{source}/**" in ignore, source
    assert any(s["value"].startswith("--from=build ") for s in steps if s["instruction"] == "COPY")
    entry = json.loads(next(s["value"] for s in steps if s["instruction"] == "ENTRYPOINT"))
    cmd = json.loads(next(s["value"] for s in steps if s["instruction"] == "CMD"))
    assert entry == ["edgeproxy"]
    assert build_parser().parse_args(cmd).config == "/etc/edgeproxy/edge.toml"


def test_systemd_unit_reloads_with_sighup_and_runs_a_worker_per_core() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(UNIT.read_text())
    service = unit["Service"]
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/edgeproxy")
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.workers == "auto"
    assert service["User"] != "root" and service["KillSignal"] == "SIGTERM"
    # systemd waits longer than the drain before it kills.
    assert float(service["TimeoutStopSec"]) > load_grace()
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def load_grace() -> float:
    text = (DEPLOY / "edge.toml").read_text()
    match = re.search(r"^grace_period = ([\d.]+)", text, re.M)
    assert match is not None
    return float(match.group(1))
