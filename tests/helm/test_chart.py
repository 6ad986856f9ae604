"""The Helm chart, checked offline: `helm lint --strict` and `helm template` of every values
file, the rendered manifests against the Kubernetes API schemas (unknown fields refused), and
the contracts: pools on their own node pools, GPU requests, SLO targets in the Serve config,
no secret in plain text, the NetworkPolicy's paths, and the chart's Serve config accepted by
the launcher's own loader. The Dockerfiles: multi-stage, non-root."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import typing
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.config import ServeConfig

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pdserve"
HELM = REPO / ".venv" / "bin" / "helm"  # deploy/get_helm.sh (run by deploy/setup.sh)
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
VALUES = [None, *EXAMPLES]
K8S_VERSIONS = ("1.29.0", "1.37.0")
CRDS = {"RayService", "ServiceMonitor", "PodMonitor"}  # no bundled schema: checked below


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM.exists(), "helm is missing: run ./deploy/setup.sh (it runs deploy/get_helm.sh)"
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def render(values: Path | None = None, *sets: str) -> list[dict[str, Any]]:
    """``sets``: ``key=<JSON value>`` (helm --set-json keeps numbers numbers)."""
    args = ["template", "rel", str(CHART), "--namespace", "llm"]
    if values is not None:
        args += ["-f", str(values)]
    for s in sets:
        args += ["--set-json", s]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def ray_service(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (rs,) = by_kind(docs, "RayService")
    return rs


def serve_args(docs: list[dict[str, Any]]) -> dict[str, Any]:
    serve = yaml.safe_load(ray_service(docs)["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == "services.app:app_from_env"
    return app["args"]


def groups(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    spec = ray_service(docs)["spec"]["rayClusterConfig"]
    out = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    out["head"] = spec["headGroupSpec"]
    return out


def name(v: Path | None) -> str:
    return "default" if v is None else v.stem


@pytest.mark.parametrize("values", VALUES, ids=name)
def test_lint_strict(values):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    out = helm(*args)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_bad_value_is_refused_by_the_schema():
    for bad in (
        "serve.mode=sideways",
        "prefill.replicass=2",
        "ports.grpc=70000",
        "model.source=pvc",
    ):
        out = helm("template", "rel", str(CHART), "--set", bad)
        assert out.returncode != 0 and "schema" in out.stderr, bad


@pytest.mark.parametrize("values", VALUES, ids=name)
def test_rendered_manifests_match_the_kubernetes_api_schemas(values):
    docs = render(values)
    kinds = {d["kind"] for d in docs}
    assert {"RayService", "Service", "NetworkPolicy"} <= kinds
    for doc in docs:
        if doc["kind"] in CRDS:
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    # the RayService's pod templates are plain PodSpecs: validate them as Pods
    for group in groups(docs).values():
        pod = {"apiVersion": "v1", "kind": "Pod", **group["template"]}
        pod["metadata"] = {"name": "p", **pod["metadata"]}
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(pod, version, strict=True)
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())


def test_ray_service_structure():
    docs = render(CHART / "examples" / "pd-gpu-pools.yaml")
    rs = ray_service(docs)
    assert rs["apiVersion"] == "ray.io/v1"
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0" and cluster["enableInTreeAutoscaling"] is True
    for g in cluster["workerGroupSpecs"]:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    monitors = {d["kind"]: d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")}
    assert monitors["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitors["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"
    (dash,) = [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["labels"].get("grafana_dashboard")
    ]
    panels = yaml.safe_load(dash["data"]["pdserve.json"])["panels"]
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for series in (
        "ttft_seconds_bucket",
        "itl_seconds_bucket",
        "kv_blocks_used",
        "prefix_hit_rate",
        "kv_transfer_failures_total",
        "kv_lease_expiries_total",
        "kv_host_buffer_bytes",
    ):
        assert series in exprs
    assert "replica_healthy" in exprs


def test_pools_land_on_their_own_node_pools_with_gpus_where_configured():
    docs = render(CHART / "examples" / "pd-gpu-pools.yaml")
    g = groups(docs)
    args = serve_args(docs)
    for role in ("prefill", "decode"):
        spec = g[role]["template"]["spec"]
        assert spec["nodeSelector"] == {"pdserve.io/pool": role}
        assert {
            "key": "pdserve.io/pool",
            "operator": "Equal",
            "value": role,
            "effect": "NoSchedule",
        } in spec["tolerations"]
        (c,) = spec["containers"]
        assert (
            c["resources"]["requests"]["nvidia.com/gpu"]
            == 1
            == c["resources"]["limits"]["nvidia.com/gpu"]
        )
        # replicas are placed by the pool's Ray resource, which only this group advertises
        resource = args[role]["resource"]
        assert resource in g[role]["rayStartParams"]["resources"]
        others = [r for r in g if r != role]
        assert all(resource not in g[o]["rayStartParams"].get("resources", "") for o in others)
        assert args[role]["num_gpus"] == 1
    assert args["device"] == "cuda"
    # the CPU demo asks for no GPU anywhere
    cpu = render(CHART / "examples" / "cpu-demo.yaml")
    assert "nvidia.com/gpu" not in yaml.safe_dump(cpu) and serve_args(cpu)["device"] == "cpu"
    # the gateway (gRPC API) is pinned to the head, which the API Services select
    assert args["gateway_resource"] in g["head"]["rayStartParams"]["resources"]
    for svc in by_kind(docs, "Service"):
        if svc["metadata"]["name"].endswith(("-http", "-grpc")):
            assert svc["spec"]["selector"]["pdserve.io/role"] == "head"


def test_slo_targets_reach_the_serve_config():
    docs = render(CHART / "examples" / "pd-gpu-pools.yaml", "prefill.autoscaling.targetS=0.65")
    args = serve_args(docs)
    assert args["prefill"]["autoscaling"]["target_s"] == 0.65
    assert args["prefill"]["autoscaling"]["queued_tokens_per_replica"] == 16384
    assert args["decode"]["autoscaling"]["target_s"] == 0.05
    assert (
        args["decode"]["autoscaling"]["min_replicas"],
        args["decode"]["autoscaling"]["max_replicas"],
    ) == (1, 8)
    assert "autoscaling" not in serve_args(render())["prefill"]  # off by default


def test_max_model_len_and_served_model_name_reach_the_serve_config():
    from services.app import config_from_args

    assert "max_model_len" not in serve_args(render())  # the model's, capped by KV capacity
    args = serve_args(render(None, "serve.maxModelLen=4096", 'serve.servedModelName="smol"'))
    cfg = config_from_args(args)
    assert (cfg.max_model_len, cfg.served_model_name) == (4096, "smol")


@pytest.mark.parametrize("values", VALUES, ids=name)
def test_the_chart_serve_config_is_what_the_launcher_loads(values):
    from services.app import app_from_env, config_from_args

    args = serve_args(render(values))
    cfg = config_from_args(args)  # the loader app_from_env uses: the chart cannot drift
    assert cfg.mode == args["mode"] and cfg.http_host == "0.0.0.0"
    assert cfg.decode.num_kv_blocks == args["decode"]["num_kv_blocks"]
    if values is not None and values.stem == "pd-gpu-pools":
        assert cfg.prefill.autoscaling is not None and cfg.prefill.autoscaling.target_s == 0.8
        assert cfg.grpc_tls_cert == "/etc/pdserve/tls/tls.crt"
        assert cfg.redis_url == "redis://rel-pdserve-redis:6379/0"
    assert type(app_from_env(args)).__name__ == "Application"


def test_secrets_are_never_rendered_in_plain_text():
    token, password = "tok-3f9a1c77e2", "pw-9be41d0a55"
    docs = render(
        None, "auth.enabled=true", f'auth.token="{token}"', f'redis.password="{password}"'
    )
    text = yaml.safe_dump(docs)
    assert token not in text and password not in text
    secrets = {s["metadata"]["name"]: s for s in by_kind(docs, "Secret")}
    assert base64.b64decode(secrets["rel-pdserve-auth"]["data"]["token"]).decode() == token
    assert base64.b64decode(secrets["rel-pdserve-redis"]["data"]["password"]).decode() == password
    # pods get them only by reference
    envs = [
        e
        for g in groups(docs).values()
        for c in g["template"]["spec"]["containers"]
        for e in c["env"]
        if e["name"] in ("PDSERVE_AUTH_TOKEN", "PDSERVE_REDIS_PASSWORD")
    ]
    assert all("valueFrom" in e and "value" not in e for e in envs)
    # the Redis password on every Ray pod (replicas publish to the index); the API token on the
    # head only (only the gateway checks it)
    by_name = [e["name"] for e in envs]
    assert by_name.count("PDSERVE_REDIS_PASSWORD") == 3 and by_name.count("PDSERVE_AUTH_TOKEN") == 1
    (head,) = groups(docs)["head"]["template"]["spec"]["containers"]
    assert "PDSERVE_AUTH_TOKEN" in [e["name"] for e in head["env"]]
    (redis,) = by_kind(docs, "StatefulSet")
    (rc,) = redis["spec"]["template"]["spec"]["containers"]
    assert rc["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "rel-pdserve-redis"
    # existing Secrets: the chart creates none and the values hold no secret
    docs = render(CHART / "examples" / "pd-gpu-pools.yaml")
    assert by_kind(docs, "Secret") == []
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for g in groups(docs).values()
        for c in g["template"]["spec"]["containers"]
        for e in c["env"]
        if "valueFrom" in e
    }
    assert refs == {"pdserve-api-token", "pdserve-redis"}


def test_the_chart_s_redis_requires_a_password_by_default():
    """No password given: the chart's Redis still gets one (random, in a Secret the pods and
    Redis read by reference); an external Redis gets none from the chart."""
    docs = render(None)
    secrets = {s["metadata"]["name"]: s for s in by_kind(docs, "Secret")}
    password = base64.b64decode(secrets["rel-pdserve-redis"]["data"]["password"]).decode()
    assert len(password) == 32 and password.isalnum()
    (redis,) = by_kind(docs, "StatefulSet")
    (rc,) = redis["spec"]["template"]["spec"]["containers"]
    assert rc["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "rel-pdserve-redis"
    assert password not in yaml.safe_dump([d for d in docs if d["kind"] != "Secret"])
    again = render(None)  # NOTE: offline render: no release to keep it from, so a new one
    assert {s["metadata"]["name"] for s in by_kind(again, "Secret")} == {"rel-pdserve-redis"}
    external = render(None, "redis.enabled=false", 'redis.externalUrl="redis://r:6379/0"')
    assert by_kind(external, "Secret") == []


def test_only_the_operator_in_its_namespace_reaches_the_dashboard():
    docs = render(None)
    rp = _policy(docs, "-ray")
    (op,) = [r for r in rp["ingress"] if {p["port"] for p in r["ports"]} == {8265, 52365}]
    assert op["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
        }
    ]
    docs = render(None, 'networkPolicy.operatorNamespace="ray-operators"')
    (op,) = [r for r in _policy(docs, "-ray")["ingress"] if r["ports"][0]["port"] == 8265]
    assert op["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ray-operators"
    }


def _policy(docs, suffix):  # type: ignore[no-untyped-def]
    (p,) = [d for d in by_kind(docs, "NetworkPolicy") if d["metadata"]["name"].endswith(suffix)]
    return p["spec"]


def test_network_policy_paths():
    docs = render(CHART / "examples" / "pd-gpu-pools.yaml")
    ray = {"app.kubernetes.io/instance": "rel", "pdserve.io/component": "ray"}
    # KV: only decode pods reach the prefill pods' KV port
    kv = _policy(docs, "-kv")
    assert kv["podSelector"]["matchLabels"] == {**ray, "pdserve.io/role": "prefill"}
    (rule,) = kv["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {**ray, "pdserve.io/role": "decode"}}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 50100}]
    assert serve_args(docs)["kv_port"] == 50100
    # Redis: only the release's Ray pods, only its port
    rd = _policy(docs, "-redis")
    (rule,) = rd["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": ray}}] and rule["ports"] == [
        {"protocol": "TCP", "port": 6379}
    ]
    # Ray's ports: Ray pods among themselves; nothing else opens the KV port or Redis
    rp = _policy(docs, "-ray")
    ports = {p["port"] for r in rp["ingress"] for p in r["ports"]}
    assert 50100 not in ports and rp["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": ray}}
    ]
    # the APIs on the head, from the ingress controller's namespace only
    api = _policy(docs, "-api")
    assert api["podSelector"]["matchLabels"]["pdserve.io/role"] == "head"
    (rule,) = api["ingress"]
    assert {p["port"] for p in rule["ports"]} == {8000, 50051}
    assert rule["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ingress-nginx"
    }
    # the Ray workers' fixed ports are the ones the policy opens
    params = groups(docs)["decode"]["rayStartParams"]
    assert int(params["min-worker-port"]) == 11000 and int(params["max-worker-port"]) == 11999


@pytest.mark.parametrize("values", VALUES, ids=name)
def test_pods_run_non_root_with_read_only_root_filesystems(values):
    docs = render(values)
    specs = [g["template"]["spec"] for g in groups(docs).values()]
    specs += [s["spec"]["template"]["spec"] for s in by_kind(docs, "StatefulSet")]
    for spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]


def test_model_sources():
    pvc = render(CHART / "examples" / "single-gpu.yaml")
    assert serve_args(pvc)["model"] == "/models/Llama-3.2-3B-Instruct"
    vols = groups(pvc)["decode"]["template"]["spec"]["volumes"]
    assert {
        "name": "models",
        "persistentVolumeClaim": {"claimName": "llm-weights", "readOnly": True},
    } in vols
    assert "prefill" not in groups(pvc)  # colocated: one pool
    dl = render(CHART / "examples" / "pd-gpu-pools.yaml")
    (init,) = groups(dl)["prefill"]["template"]["spec"]["initContainers"]
    assert "https://models.example.com/llama-3.1-8b-instruct-q8_0.gguf" in init["args"]
    assert "model" not in serve_args(render())  # embedded: the packaged SmolLM2


def test_the_converted_model_cache_is_shared_where_a_claim_is_named():
    """Every pod of both pools mounts the one claim at /cache (PDSERVE_CACHE_DIR); without
    one, each pod has its own bounded emptyDir."""
    shared = render(CHART / "examples" / "pd-gpu-pools.yaml")
    pods = [g["template"]["spec"] for g in groups(shared).values()]
    pods.append(
        ray_service(shared)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    )
    for spec in pods:
        (cache,) = [v for v in spec["volumes"] if v["name"] == "cache"]
        assert cache == {
            "name": "cache",
            "persistentVolumeClaim": {"claimName": "pdserve-model-cache"},
        }
        (c,) = [c for c in spec["containers"] if c["name"] != "fetch-model"][:1]
        assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]
        assert {"name": "PDSERVE_CACHE_DIR", "value": "/cache"} in c["env"]
    (own,) = [
        v for v in groups(render())["decode"]["template"]["spec"]["volumes"] if v["name"] == "cache"
    ]
    assert own == {"name": "cache", "emptyDir": {"sizeLimit": "40Gi"}}


@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_dockerfiles_are_multi_stage_and_non_root(flavour):
    text = (REPO / "deploy" / "docker" / f"Dockerfile.{flavour}").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    froms = [ln for ln in lines if ln.startswith("FROM ")]
    assert len(froms) >= 2 and " AS build" in froms[0] and "COPY --from=build" in text
    users = [ln for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] != "USER root" and not users[-1].startswith("USER 0")
    assert "wget" in text  # KubeRay's probes


def test_ray_token_auth_is_on_by_default():
    spec = ray_service(render(None))["spec"]["rayClusterConfig"]
    assert spec["authOptions"] == {"mode": "token"}
    own = ray_service(render(None, 'rayAuth.existingSecret="ray-token"'))["spec"]
    assert own["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    off = ray_service(render(None, "rayAuth.enabled=false"))["spec"]["rayClusterConfig"]
    assert "authOptions" not in off


def test_kv_mutual_tls_mounts_its_secret_and_reaches_the_serve_config():
    docs = render(None, "kvTls.enabled=true", 'kvTls.secretName="kv-certs"')
    args = serve_args(docs)
    assert args["kv_tls_cert"] == "/etc/pdserve/kv-tls/tls.crt"
    assert args["kv_tls_ca"] == "/etc/pdserve/kv-tls/ca.crt"
    assert args["kv_tls_server_name"] == "pdserve-kv"
    for g in groups(docs).values():
        spec = g["template"]["spec"]
        assert {"name": "kv-tls", "secret": {"secretName": "kv-certs"}} in spec["volumes"]
        (c,) = spec["containers"]
        assert {"name": "kv-tls", "mountPath": "/etc/pdserve/kv-tls", "readOnly": True} in c[
            "volumeMounts"
        ]
    from services.config import load_config

    cfg = load_config(overrides=args, environ={})  # the launcher's own loader accepts it
    assert cfg.kv_tls_server_name == "pdserve-kv"
    assert "kv_tls_cert" not in serve_args(render(None))


def test_tenant_keys_reach_the_head_only():
    docs = render(None, 'auth.apiKeysSecret="pdserve-tenants"')
    for group_name, g in groups(docs).items():
        (c,) = g["template"]["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        if group_name == "head":
            ref = env["PDSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "pdserve-tenants", "key": "api_keys"}
        else:
            assert "PDSERVE_API_KEYS" not in env


@pytest.mark.parametrize("plane, env, opened", [("grpc", "1", True), ("actor", "0", False)])
def test_the_serve_data_plane_reaches_every_ray_pod_and_the_network_policy(plane, env, opened):
    """Ray Serve reads RAY_SERVE_USE_GRPC_BY_DEFAULT in each process: every Ray pod carries
    it; with grpc, replicas listen on ephemeral ports, which the policy opens to the release's
    own Ray pods only."""
    docs = render(CHART / "examples" / "pd-gpu-pools.yaml", f'serve.serveDataPlane="{plane}"')
    assert serve_args(docs)["serve_data_plane"] == plane
    for g in groups(docs).values():
        (c,) = g["template"]["spec"]["containers"]
        assert {e["name"]: e.get("value") for e in c["env"]}["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == env
    rp = _policy(docs, "-ray")
    (peers,) = [r for r in rp["ingress"] if r.get("from") == rp["ingress"][0]["from"]]
    ephemeral = {"protocol": "TCP", "port": 32768, "endPort": 60999}
    assert (ephemeral in peers["ports"]) is opened
    assert all(ephemeral not in r["ports"] for r in rp["ingress"] if r is not peers)


def test_the_schema_s_choices_are_the_serve_config_s():
    """Each ``serve`` value the schema restricts to a list takes exactly the choices of the
    ServeConfig field it renders into (camelCase -> snake_case): a choice the engine gained
    is offered by the chart, and the chart offers nothing the loader refuses."""
    props = json.loads((CHART / "values.schema.json").read_text())["properties"]["serve"]
    checked = 0
    for key, spec in props["properties"].items():
        enums = [e for s in (spec, *spec.get("anyOf", ())) for e in s.get("enum", ())]
        if not enums:
            continue
        field = ServeConfig.model_fields[re.sub(r"([A-Z])", r"_\1", key).lower()]
        choices = {
            a
            for t in (field.annotation, *typing.get_args(field.annotation))
            if typing.get_origin(t) is typing.Literal
            for a in typing.get_args(t)
        }
        assert set(enums) == choices, key
        checked += 1
    assert checked >= 6
