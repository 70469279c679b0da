"""KubeRay RayService manifests generated from the Serve config files, and their offline checks.

manifests/*.yaml stay the one source of truth: `specserve kuberay render` turns each layout's
manifest into a RayService (ray.io/v1) under deploy/ whose `serveConfigV2` is that manifest, and
whose worker groups are sized from its pools. tests/test_deploy.py fails when a committed file
is stale. The serve config changes for Kubernetes only where it must:
- `http_options.host` becomes 0.0.0.0: KubeRay's serve Service reaches the proxies on pod IPs
  (Serve's gRPC proxy already listens on every interface, `[::]:port`; metrics are the nodes'
  `--metrics-export-port`, a rayStartParam here, not Serve config);
- each GPU pool is pinned to its own worker group: the group's nodes advertise one
  `specserve_<pool>_slot` resource and every replica of the pool asks for one (in its first
  placement bundle, else in ray_actor_options). Without it a 1-GPU draft replica may land on a
  4-GPU target node and leave 3 GPUs no STRICT_PACK target replica can use.

`specserve kuberay check FILE...` validates RayService files offline (render runs it too): against
the KubeRay CRD's openAPIV3Schema (vendored in deploy/crds/) with unknown fields rejected and keyed
lists free of duplicates, then the embedded serveConfigV2 against Ray's ServeDeploySchema (keys it
would ignore refused) and specserve's AppArgs.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import posixpath
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from specserve.protocol import SpecserveError

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
DEPLOY = REPO / "deploy"
KUBERAY_VERSION = "1.7.0"
CRD_SCHEMA = DEPLOY / "crds" / f"rayservice-v1-kuberay-{KUBERAY_VERSION}.schema.json"
CRD_SOURCE = "ray-operator/config/crd/bases/ray.io_rayservices.yaml"  # in ray-project/kuberay
RAY_VERSION = "2.60.0"
SPECSERVE_VERSION = "0.1.0"
BUILD_APP = "specserve.serve:build_app"

# KubeRay's names: a head container port named `serve` or `serve-*` goes into the RayService's
# serve Service (<name>-serve-svc); the metrics export port is named `metrics` (8080).
METRICS_PORT = 8080
DASHBOARD_PORT = 8265
GCS_PORT = 6379
CLIENT_PORT = 10001
# Model credentials: `kubectl create secret generic specserve-hf-token --from-literal=HF_TOKEN=hf_...`
HF_TOKEN_SECRET = "specserve-hf-token"
HF_TOKEN_KEY = "HF_TOKEN"
HF_HOME = "/home/ray/.cache/huggingface"
# The API key (manifest `auth:`): `kubectl create secret generic specserve-api-key --from-literal=api-key=...`
API_KEY_SECRET = "specserve-api-key"
API_KEY_KEY = "api-key"
POD_LABELS = {"app.kubernetes.io/part-of": "specserve"}  # what deploy/monitoring selects
GPU = "nvidia.com/gpu"


class DeployError(SpecserveError):
    """A manifest that cannot become the layout's RayService, or a RayService that fails a check."""


@dataclass(frozen=True)
class Node:
    """One pod = one Ray node: its container's requests and limits (Guaranteed QoS)."""

    cpus: int
    memory: str
    disk: str | None = None  # ephemeral storage; the model cache (an emptyDir) is on it
    gpus: int = 0

    def resources(self) -> dict[str, dict[str, str]]:
        amounts = {"cpu": str(self.cpus), "memory": self.memory}
        if self.disk:
            amounts["ephemeral-storage"] = self.disk
        if self.gpus:
            amounts[GPU] = str(self.gpus)
        return {"requests": dict(amounts), "limits": dict(amounts)}


@dataclass(frozen=True)
class Layout:
    """How one manifest runs on Kubernetes: what the manifest cannot say (node shapes, image)."""

    name: str  # the RayService's name
    manifest: str  # under manifests/
    out: str  # under deploy/
    image: str
    head: Node
    cpu_node: Node  # the `cpu` group: the router and every pool without GPUs
    gpu_nodes: dict[str, Node] = field(default_factory=dict)  # per GPU pool; GPUs per node come from the pool
    hf_token_optional: bool = True  # False where the models are gated: the pod waits for the secret
    gpu_idle_timeout_s: int = 300  # a GPU node takes minutes to load its model: keep it a while


def image(variant: str) -> str:
    """The tag `docker build -f deploy/Dockerfile` gives (README, "Kubernetes (KubeRay)")."""
    return f"specserve:{SPECSERVE_VERSION}-ray{RAY_VERSION}-py311-{variant}"


LAYOUTS = {
    "llama70b": Layout(
        name="specserve-llama70b", manifest="llama70b.yaml", out="llama70b/rayservice.yaml",
        image=image("gpu"), hf_token_optional=False,  # Llama weights are gated on the Hub
        head=Node(cpus=8, memory="32Gi"),
        cpu_node=Node(cpus=4, memory="16Gi"),
        gpu_nodes={"target": Node(cpus=32, memory="320Gi", disk="400Gi"),  # 141 GB of bf16 weights
                   "draft": Node(cpus=8, memory="48Gi", disk="64Gi")}),
    "cpu": Layout(
        name="specserve-cpu", manifest="local.yaml", out="cpu/rayservice.yaml", image=image("cpu"),
        head=Node(cpus=2, memory="4Gi"),
        # both pools and the router (1.6 CPUs) on one 2-core node, as `make serve` runs them
        cpu_node=Node(cpus=2, memory="12Gi", disk="20Gi")),
}
MONITOR_OUT = "monitoring/podmonitor.yaml"


# --------------------------------------------------------------------------- pools → groups


@dataclass(frozen=True)
class Deployment:
    """One Serve deployment of the app as the cluster sees it: per-replica resources and bounds."""

    pool: str  # target, draft, router
    cpus: float
    gpus: float
    min_replicas: int
    max_replicas: int


def replica_bounds(args: dict[str, Any]) -> tuple[int, int]:
    """(min, max) replicas of a deployment's args: autoscaling_config's, else num_replicas (Serve's defaults: 1)."""
    scaling = args.get("autoscaling_config")
    if scaling:
        return int(scaling.get("min_replicas", 1)), int(scaling.get("max_replicas", 1))
    replicas = 1 if args.get("num_replicas") is None else args["num_replicas"]
    if replicas == "auto":
        raise DeployError(f"{args.get('model', 'router')}: num_replicas 'auto' has no bound to size a worker "
                          "group from; give autoscaling_config min_replicas and max_replicas")
    return int(replicas), int(replicas)


def replica_resources(args: dict[str, Any]) -> tuple[float, float]:
    """(CPUs, GPUs) one replica holds: its placement bundles together (one node under STRICT_PACK),
    else its actor options. Serve's replica actor takes the first bundle's share."""
    bundles = args.get("placement_group_bundles")
    if bundles:
        return sum(b.get("CPU", 0) for b in bundles), sum(b.get("GPU", 0) for b in bundles)
    options = args.get("ray_actor_options") or {"num_cpus": 1}
    return float(options.get("num_cpus", 1)), float(options.get("num_gpus", 0))


def deployments(app_args: dict[str, Any]) -> list[Deployment]:
    """The app's deployments, from its validated args (specserve.serve.config.AppArgs)."""
    from specserve.serve.config import AppArgs

    parsed = AppArgs.model_validate(app_args).model_dump()
    found = []
    for pool in ("target", "draft", "router"):
        if parsed.get(pool) is not None:
            cpus, gpus = replica_resources(parsed[pool])
            found.append(Deployment(pool, cpus, gpus, *replica_bounds(parsed[pool])))
    return found


def slot_resource(pool: str) -> str:
    return f"specserve_{pool}_slot"


def pin_pool(pool_args: dict[str, Any], pool: str) -> dict[str, Any]:
    """The pool's args asking for one slot of its worker group per replica."""
    pinned = copy.deepcopy(pool_args)
    if pinned.get("placement_group_bundles"):
        pinned["placement_group_bundles"][0][slot_resource(pool)] = 1
    else:
        options = pinned.setdefault("ray_actor_options", {})
        options["resources"] = {**options.get("resources", {}), slot_resource(pool): 1}
    return pinned


def only_app(manifest: dict[str, Any], source: str) -> dict[str, Any]:
    """The manifest's one application: a layout sizes the cluster for one specserve app."""
    apps = manifest.get("applications") or []
    if len(apps) != 1:
        raise DeployError(f"{source}: {len(apps)} applications; a layout sizes its cluster for exactly one")
    if apps[0].get("import_path") != BUILD_APP:
        raise DeployError(f"{source}: import_path {apps[0].get('import_path')!r} is not {BUILD_APP}")
    return apps[0]


def serve_config(manifest: dict[str, Any], gpu_pools: list[str]) -> dict[str, Any]:
    """The manifest as the cluster's Serve config (the changes the module docstring lists)."""
    config = copy.deepcopy(manifest)
    config.setdefault("http_options", {})["host"] = "0.0.0.0"
    args = config["applications"][0]["args"]
    for pool in gpu_pools:
        args[pool] = pin_pool(args[pool], pool)
    return config


def fits(node: Node, cpus: float, gpus: float) -> bool:
    return cpus <= node.cpus and gpus <= node.gpus


def worker_groups(layout: Layout, deps: list[Deployment], ports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A group per GPU pool (one replica per node, GPUs per node from the pool), and the `cpu`
    group, whose min and max nodes hold the rest's min and max replicas by CPU."""
    source = f"manifests/{layout.manifest}"
    gpu_deps = [d for d in deps if d.gpus]
    on_cpu = [d for d in deps if not d.gpus]
    if {d.pool for d in gpu_deps} != set(layout.gpu_nodes):
        raise DeployError(f"{source}: pools on GPUs {sorted(d.pool for d in gpu_deps)}, but the layout has GPU "
                          f"groups for {sorted(layout.gpu_nodes)}; change the manifest or LAYOUTS")
    groups = []
    for dep in gpu_deps:
        node = replace(layout.gpu_nodes[dep.pool], gpus=math.ceil(dep.gpus))
        if not fits(node, dep.cpus, dep.gpus):
            raise DeployError(f"{source}: a {dep.pool} replica needs {dep.cpus:g} CPUs, more than its group's "
                              f"nodes have ({node.cpus})")
        groups.append(group_spec(layout, dep.pool, node, ports, dep.min_replicas, dep.max_replicas,
                                 ray_resources={slot_resource(dep.pool): "1"}))
    for dep in on_cpu:
        if not fits(layout.cpu_node, dep.cpus, 0):
            raise DeployError(f"{source}: a {dep.pool} replica needs {dep.cpus:g} CPUs, more than a cpu node "
                              f"has ({layout.cpu_node.cpus})")
    low = math.ceil(sum(d.cpus * d.min_replicas for d in on_cpu) / layout.cpu_node.cpus)
    high = math.ceil(sum(d.cpus * d.max_replicas for d in on_cpu) / layout.cpu_node.cpus)
    groups.append(group_spec(layout, "cpu", layout.cpu_node, ports, max(low, 1), max(high, 1)))
    return groups


# --------------------------------------------------------------------------- pod templates


def container_env(layout: Layout) -> list[dict[str, Any]]:
    token = {"name": HF_TOKEN_SECRET, "key": HF_TOKEN_KEY}
    if layout.hf_token_optional:
        token["optional"] = True
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": token}},
            {"name": "HF_HOME", "value": HF_HOME}]


def add_api_key(template: dict[str, Any], auth: dict[str, Any] | None) -> None:
    """Give a pod the API key the manifest's `auth:` names, from the Secret API_KEY_SECRET: as the
    environment variable `api_key_env` and/or the file `api_key_file` (a mounted Secret: the
    kubelet updates it when the Secret changes and the router re-reads it, so keys rotate
    without a restart). Not optional: the app is built on the head and each router replica
    reads the key where it runs, and a missing key must stop the pod, not open the API."""
    if not auth:
        return
    container, spec = template["spec"]["containers"][0], template["spec"]
    if auth.get("api_key_env"):
        container["env"].append({"name": auth["api_key_env"],
                                 "valueFrom": {"secretKeyRef": {"name": API_KEY_SECRET, "key": API_KEY_KEY}}})
    if auth.get("api_key_file"):
        directory, name = posixpath.split(auth["api_key_file"])
        if not directory.startswith("/") or not name:
            raise DeployError(f"auth.api_key_file {auth['api_key_file']!r}: give an absolute file path, "
                              "e.g. /etc/specserve/api-key")
        spec["volumes"].append({"name": "api-key", "secret": {"secretName": API_KEY_SECRET,
                                                              "items": [{"key": API_KEY_KEY, "path": name}]}})
        container["volumeMounts"].append({"name": "api-key", "mountPath": directory, "readOnly": True})


def container_ports(http_port: int, grpc_port: int, head: bool) -> list[dict[str, Any]]:
    ports = [{"name": "serve", "containerPort": http_port},
             {"name": "serve-grpc", "containerPort": grpc_port},
             {"name": "metrics", "containerPort": METRICS_PORT}]
    if head:
        ports += [{"name": "gcs-server", "containerPort": GCS_PORT},
                  {"name": "dashboard", "containerPort": DASHBOARD_PORT},
                  {"name": "client", "containerPort": CLIENT_PORT}]
    return ports


def pod_template(layout: Layout, node: Node, ports: list[dict[str, Any]], head: bool) -> dict[str, Any]:
    container = {
        "name": "ray-head" if head else "ray-worker",
        "image": layout.image,
        "imagePullPolicy": "IfNotPresent",
        "env": container_env(layout),
        "ports": ports,
        "resources": node.resources(),
        "volumeMounts": [{"name": "model-cache", "mountPath": HF_HOME}],
    }
    volumes = [{"name": "model-cache", "emptyDir": {"sizeLimit": node.disk} if node.disk else {}}]
    spec: dict[str, Any] = {"containers": [container], "volumes": volumes}
    if node.gpus:
        # vLLM's tensor-parallel workers and NCCL share memory through /dev/shm
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        spec["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    if not head:
        # Let Ray drain the node before Kubernetes kills it (scale-down, eviction)
        container["lifecycle"] = {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}}
    labels = {**POD_LABELS, "app.kubernetes.io/instance": layout.name}
    return {"metadata": {"labels": labels}, "spec": spec}


def group_spec(layout: Layout, name: str, node: Node, ports: list[dict[str, Any]], low: int, high: int,
               ray_resources: dict[str, str] | None = None) -> dict[str, Any]:
    group: dict[str, Any] = {
        "groupName": name, "replicas": low, "minReplicas": low, "maxReplicas": high,
        "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
    }
    if ray_resources:
        group["resources"] = ray_resources
    if node.gpus:
        group["idleTimeoutSeconds"] = layout.gpu_idle_timeout_s
    group["template"] = pod_template(layout, node, ports, head=False)
    return group


# --------------------------------------------------------------------------- the RayService


def rayservice(layout: Layout, manifest: dict[str, Any]) -> dict[str, Any]:
    """The layout's RayService object for `manifest` (a parsed Serve config file)."""
    deps = deployments(only_app(manifest, f"manifests/{layout.manifest}")["args"])
    config = serve_config(manifest, [d.pool for d in deps if d.gpus])
    http_port = config["http_options"].get("port", 8000)
    grpc_port = (config.get("grpc_options") or {}).get("port", 9000)
    groups = worker_groups(layout, deps, container_ports(http_port, grpc_port, head=False))
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0",
                           "metrics-export-port": str(METRICS_PORT)},
        "template": pod_template(layout, layout.head, container_ports(http_port, grpc_port, head=True), head=True),
    }
    auth = only_app(manifest, f"manifests/{layout.manifest}")["args"].get("auth")
    for template in [head["template"], *(g["template"] for g in groups)]:
        add_api_key(template, auth)
    cluster: dict[str, Any] = {"rayVersion": RAY_VERSION}
    if any(g["minReplicas"] < g["maxReplicas"] for g in groups):
        cluster["enableInTreeAutoscaling"] = True
        cluster["autoscalerOptions"] = {
            "version": "v2", "upscalingMode": "Default", "idleTimeoutSeconds": 60,
            "resources": Node(cpus=1, memory="1Gi").resources()}
    cluster.update({"authOptions": {"mode": "token"}, "headGroupSpec": head, "workerGroupSpecs": groups})
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": layout.name, "labels": {**POD_LABELS, "app.kubernetes.io/instance": layout.name}},
        "spec": {
            # With a proxy on every node, traffic goes to the workers' proxies and spares the head (GCS)
            "excludeHeadPodFromServeSvc": config.get("proxy_location", "EveryNode") == "EveryNode",
            "serveConfigV2": f"# manifests/{layout.manifest}, for Kubernetes (specserve/kuberay.py)\n"
                             + dump_yaml(config),
            "rayClusterConfig": cluster},
    }


def podmonitor() -> dict[str, Any]:
    """One PodMonitor for every specserve RayService's Ray nodes, head and workers: the `metrics`
    port (Ray's metrics export port), with KubeRay's cluster, node type and group as labels."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "specserve-ray-nodes", "labels": dict(POD_LABELS)},
        "spec": {
            "selector": {"matchLabels": {**POD_LABELS, "ray.io/is-ray-node": "yes"},
                         "matchExpressions": [{"key": "ray.io/node-type", "operator": "In",
                                               "values": ["head", "worker"]}]},
            "podTargetLabels": ["ray.io/cluster", "ray.io/node-type", "ray.io/group", "app.kubernetes.io/instance"],
            "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
        },
    }


# --------------------------------------------------------------------------- YAML out


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None  # serveConfigV2 reads as YAML, not one escaped line
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)
_Dumper.ignore_aliases = lambda self, data: True  # groups share a ports list: write it out each time


def dump_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110)


def header(source: str) -> str:
    return (f"# GENERATED by `specserve kuberay render` (make kuberay) from {source}.\n"
            "# Do not edit by hand: change the source and regenerate (tests/test_deploy.py fails while\n"
            "# this file is stale).\n")


def render_layout(key: str, manifests: Path = MANIFESTS, registry: str = "") -> str:
    """The layout's RayService file; `registry` prefixes the image (`registry/specserve:<tag>`)."""
    layout = LAYOUTS[key]
    if registry:
        layout = replace(layout, image=f"{registry.rstrip('/')}/{layout.image}")
    manifest = yaml.safe_load((manifests / layout.manifest).read_text())
    obj = rayservice(layout, manifest)
    errors = check(obj)  # never write a file the checks would refuse
    if errors:
        raise DeployError(f"the RayService from manifests/{layout.manifest} fails its checks:\n  "
                          + "\n  ".join(errors))
    source = f"manifests/{layout.manifest}\n# and LAYOUTS[{key!r}] in specserve/kuberay.py"
    return header(source) + dump_yaml(obj)


def render_all(manifests: Path = MANIFESTS, registry: str = "") -> dict[str, str]:
    """Every generated file under deploy/, by its path there."""
    files = {layout.out: render_layout(key, manifests, registry) for key, layout in LAYOUTS.items()}
    files[MONITOR_OUT] = header("podmonitor() in specserve/kuberay.py") + dump_yaml(podmonitor())
    return files


def write_all(deploy: Path = DEPLOY, manifests: Path = MANIFESTS, registry: str = "") -> list[Path]:
    written = []
    for rel, text in render_all(manifests, registry).items():
        path = deploy / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


# --------------------------------------------------------------------------- offline checks


def extract_crd_schema(crd: dict[str, Any], version: str = "v1") -> dict[str, Any]:
    """`spec.versions[name=version].schema.openAPIV3Schema` of a CRD document."""
    for entry in crd.get("spec", {}).get("versions", []):
        if entry.get("name") == version:
            return entry["schema"]["openAPIV3Schema"]
    raise DeployError(f"the CRD has no version {version!r}")


def write_crd_schema(crd_yaml: str, out: Path = CRD_SCHEMA) -> Path:
    """Vendor the schema from the CRD's YAML text (deploy/crds/README.md says where it comes from)."""
    text = json.dumps(extract_crd_schema(yaml.safe_load(crd_yaml)), sort_keys=True, separators=(",", ":"))
    out.parent.mkdir(parents=True, exist_ok=True)
    if len(text) > 1 << 20:
        out = out.with_name(out.name + ".gz")
        out.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        out.write_text(text + "\n")
    return out


def load_crd_schema(path: Path = CRD_SCHEMA) -> dict[str, Any]:
    gz = path.with_name(path.name + ".gz")
    if not path.exists() and gz.exists():
        return json.loads(gzip.decompress(gz.read_bytes()))
    return json.loads(path.read_text())


def strict_schema(schema: Any) -> Any:
    """The schema as Kubernetes' structural schema checks it, in JSON Schema Draft 7 terms:
    an object that lists `properties` rejects others unless it preserves unknown fields (the
    API server would silently prune them: a typo would vanish), `x-kubernetes-int-or-string`
    takes an integer or a string, and `nullable` takes null."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else [*out["type"], "null"]
    return out


def json_path(parts: Any) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(top)"


def list_key_errors(obj: Any, schema: dict[str, Any], path: tuple = ()) -> list[str]:
    """Duplicates in lists the schema declares as maps or sets (`x-kubernetes-list-type`), which
    the API server refuses and JSON Schema cannot say: two container ports 8000, two env HF_TOKEN."""
    errors = []
    if isinstance(obj, dict):
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            sub = schema.get("properties", {}).get(key, extra if isinstance(extra, dict) else None)
            if sub:
                errors += list_key_errors(value, sub, (*path, key))
    elif isinstance(obj, list):
        items = schema.get("items", {})
        kind, key_names = schema.get("x-kubernetes-list-type"), schema.get("x-kubernetes-list-map-keys", [])
        defaults = {k: items.get("properties", {}).get(k, {}).get("default") for k in key_names}
        seen: dict[str, int] = {}
        for i, item in enumerate(obj):
            if kind == "map" and isinstance(item, dict):
                key = json.dumps({k: item.get(k, defaults[k]) for k in key_names}, sort_keys=True)
            elif kind == "set":
                key = json.dumps(item, sort_keys=True)
            else:
                key = None
            if key is not None and key in seen:
                errors.append(f"{json_path((*path, i))}: duplicate of {json_path((*path, seen[key]))} ({key})")
            elif key is not None:
                seen[key] = i
            errors += list_key_errors(item, items, (*path, i))
    return errors


def crd_errors(obj: dict[str, Any], schema: dict[str, Any] | None = None) -> list[str]:
    """Where `obj` breaks the RayService CRD's schema, as 'path: message' lines (none when valid)."""
    from jsonschema import Draft7Validator

    schema = schema if schema is not None else load_crd_schema()
    validator = Draft7Validator(strict_schema(schema))
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{json_path(e.absolute_path)}: {e.message}" for e in errors] + list_key_errors(obj, schema)


def serve_config_errors(obj: dict[str, Any]) -> list[str]:
    """Where the RayService's serveConfigV2 breaks Ray's ServeDeploySchema or specserve's AppArgs."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from specserve.serve.config import AppArgs

    where = "spec.serveConfigV2"
    try:
        config = yaml.safe_load(obj["spec"]["serveConfigV2"])
    except (KeyError, TypeError):
        return [f"{where}: missing"]
    except yaml.YAMLError as exc:
        return [f"{where}: not YAML: {exc}"]
    try:
        schema = ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        return [f"{where}.{json_path(e['loc'])}: {e['msg']}" for e in exc.errors()]
    errors = unknown_keys(config, schema, where)
    for i, app in enumerate(schema.applications):
        if app.import_path != BUILD_APP:
            continue
        try:
            AppArgs.model_validate(app.args)
        except ValidationError as exc:
            errors += [f"{where}.applications[{i}].args.{json_path(e['loc'])}: {e['msg']}" for e in exc.errors()]
    return errors


def unknown_keys(raw: Any, model: Any, path: str) -> list[str]:
    """Keys of `raw` that its pydantic `model` has no field for. Ray's Serve schemas ignore them,
    so a misspelt option (`grpc_option:`) would vanish without a word; here it is an error."""
    from pydantic import BaseModel

    if not (isinstance(model, BaseModel) and isinstance(raw, dict)):
        return []
    by_key = {(f.alias or name): name for name, f in type(model).model_fields.items()}
    by_key.update({name: name for name in type(model).model_fields})
    errors = []
    for key, value in raw.items():
        if key not in by_key:
            errors.append(f"{path}.{key}: unknown field ({type(model).__name__} would ignore it)")
            continue
        field_value = getattr(model, by_key[key])
        if isinstance(field_value, list) and isinstance(value, list):
            for i, (item_raw, item) in enumerate(zip(value, field_value)):
                errors += unknown_keys(item_raw, item, f"{path}.{key}[{i}]")
        else:
            errors += unknown_keys(value, field_value, f"{path}.{key}")
    return errors


def check(obj: Any) -> list[str]:
    """Every offline check on one RayService object."""
    if not isinstance(obj, dict) or obj.get("kind") != "RayService":
        return ["(top): not a RayService (kind: RayService)"]
    errors = crd_errors(obj)
    return errors + serve_config_errors(obj) if not errors else errors


def check_file(path: Path) -> list[str]:
    return [f"{path}: {e}" for doc in yaml.safe_load_all(path.read_text()) if doc is not None for e in check(doc)]


def stale_files(deploy: Path = DEPLOY, manifests: Path = MANIFESTS) -> list[str]:
    """Generated files that differ from what the manifests give now."""
    return [rel for rel, text in render_all(manifests).items()
            if not (deploy / rel).exists() or (deploy / rel).read_text() != text]
