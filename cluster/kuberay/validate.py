"""Checks of rendered KubeRay manifests: the KubeRay CRD schema, and what makes them deploy.

The schema is the CRDs of KubeRay ``KUBERAY_VERSION`` (tests/data/kuberay-<version>/, SOURCE.md
there says where they come from), made strict the way the API server's field validation is: an
object with declared properties takes no other field, unless it is marked
``x-kubernetes-preserve-unknown-fields``. So a misspelt field is an error here, not a field the
API server drops.
"""
from __future__ import annotations

import shlex
from functools import lru_cache
from pathlib import PurePosixPath

import yaml

from cluster.kuberay.options import REPO, DeployConfig, Group, pool_group
from cluster.kuberay.training import CONFIG_KEY, CONFIG_MOUNT, LoadConfig, deployed_config

KUBERAY_VERSION = "1.7.0"
CRD_DIR = REPO / "tests" / "data" / f"kuberay-{KUBERAY_VERSION}"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
EXPOSED = ("NodePort", "LoadBalancer")


def _strict(node):
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@lru_cache(maxsize=None)
def crd_validator(kind: str):
    """A jsonschema validator of ``kind``'s ray.io/v1 schema (strict, see the module docstring)."""
    import jsonschema

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def schema_problems(doc: dict) -> list[str]:
    kind = doc.get("kind")
    if kind not in CRD_FILES:
        return []
    return [f"{kind} {doc['metadata']['name']}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: "
            f"{e.message}" for e in crd_validator(kind).iter_errors(doc)]


def _templates(spec: dict) -> dict[str, dict]:
    """{group name or 'head': pod template} of a RayCluster spec."""
    out = {"head": spec["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in spec.get("workerGroupSpecs", [])})
    return out


def pod_problems(spec: dict, dc: DeployConfig) -> list[str]:
    """Images, GPUs, the shared volume and exposure of every pod of a RayCluster spec."""
    out = []
    head = spec["headGroupSpec"]
    if head.get("serviceType", "ClusterIP") != "ClusterIP" or head.get("enableIngress"):
        out.append("head: its service must stay ClusterIP without ingress (GCS and dashboard "
                   "inside the cluster)")
    if (head.get("headService") or {}).get("spec", {}).get("type") in EXPOSED:
        out.append("head: headService exposes the head outside the cluster")
    head_mounts = head["template"]["spec"]["containers"][0].get("volumeMounts", [])
    if not any(m["mountPath"] == CONFIG_MOUNT for m in head_mounts):
        out.append(f"head: the driver's config overlay is not mounted at {CONFIG_MOUNT}")
    for name, tmpl in _templates(spec).items():
        pod = tmpl["spec"]
        if pod.get("hostNetwork"):
            out.append(f"{name}: hostNetwork puts Ray's ports on the node")
        claims = {v["name"] for v in pod.get("volumes", [])
                  if v.get("persistentVolumeClaim", {}).get("claimName") == dc.pvc}
        for c in pod["containers"]:
            if c["image"] != dc.image or c["image"].endswith(":latest"):
                out.append(f"{name}: image {c['image']}, not the pinned GPU image {dc.image}")
            if any("hostPort" in p for p in c.get("ports", [])):
                out.append(f"{name}: a hostPort exposes a Ray port on the node")
            if not any(m["name"] in claims and m["mountPath"] == dc.mount
                       for m in c.get("volumeMounts", [])):
                out.append(f"{name}: the volume {dc.pvc} is not mounted at {dc.mount}")
            res = c.get("resources", {})
            gpus = {str(res.get(k, {}).get("nvidia.com/gpu", "0")) for k in ("limits", "requests")}
            want = "0" if name == "head" else str(getattr(dc, name).gpus_per_pod)
            if gpus != {want}:
                out.append(f"{name}: nvidia.com/gpu limits/requests {sorted(gpus)}, expected {want}")
    return out


def cluster_totals(spec: dict, at: str = "replicas") -> dict[str, float]:
    """The Ray resources the cluster offers with every group at ``at`` (replicas, maxReplicas):
    the head's and groups' ``resources``, CPUs and GPUs from container limits as KubeRay does."""
    total: dict[str, float] = {}

    def add(res: dict, times: int) -> None:
        for k, v in res.items():
            total[k] = total.get(k, 0.0) + float(v) * times

    add(spec["headGroupSpec"].get("resources", {}), 1)
    for g in spec["workerGroupSpecs"]:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        add({"CPU": limits["cpu"], "GPU": limits.get("nvidia.com/gpu", 0), **g.get("resources", {})},
            int(g[at]))
    return total


def plan_problems(spec: dict, dc: DeployConfig, cfg) -> list[str]:
    """The pools of the job's config ``cfg`` (cluster/resources.py plan) fit the cluster ``spec``
    at its replicas, and each pool's custom resource is offered by its own group only."""
    from cluster.resources import plan, shortfalls

    out = [f"pools need {res} {need:g} ({parts}), the pods offer {have:g} (key {key})"
           for key, res, need, have, parts in shortfalls(cfg, cluster_totals(spec))]
    offered = {"head": set(spec["headGroupSpec"].get("resources", {}))}
    offered.update({g["groupName"]: set(g.get("resources", {})) for g in spec["workerGroupSpecs"]})
    for pool, (_, req) in plan(cfg).items():
        want = "head" if pool == "buffer" else pool_group(dc, pool)
        custom = [k for k in req if k not in ("CPU", "GPU")]
        if not custom:
            out.append(f"{pool}: asks no custom resource, so it may land on any pod")
        for key in custom:
            where = sorted(n for n, keys in offered.items() if key in keys)
            if where != [want]:
                out.append(f"{pool}: its resource {key} is offered by {where}, not by {want} only")
    return out


def job_problems(job: dict, dc: DeployConfig, cfg) -> list[str]:
    """The RayJob ``job`` resumes, cleans up, and runs ``cfg`` (its config) on the volume."""
    from cluster.ray_setup import worker_env

    out = []
    spec = job["spec"]
    if spec.get("shutdownAfterJobFinishes") is not True:
        out.append("RayJob: shutdownAfterJobFinishes must be true (the job's cluster goes with it)")
    argv = shlex.split(spec["entrypoint"])
    if not argv[1].startswith("/") or "resume=latest" not in argv:
        out.append("RayJob: the entrypoint must run an absolute launch/train.py with resume=latest")
    for key, value in (("rollout.model_path", cfg.rollout.model_path), ("run.out_dir", cfg.run.out_dir)):
        if not PurePosixPath(value).is_relative_to(dc.mount):
            out.append(f"RayJob: {key}={value} is not on the volume ({dc.mount})")
    paths = [cfg.task.path, cfg.task.heldout_path] + [s.path for s in cfg.task.eval_sets]
    out += [f"RayJob: data path {p} is relative" for p in paths if p and not p.startswith("/")]
    env = (yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}).get("env_vars", {})
    clash = sorted(set(env) & set(worker_env()))
    if clash:  # Ray refuses to merge the job's runtime env with ray.init's ("Failed to merge")
        out.append(f"RayJob: runtimeEnvYAML sets {clash}, which ray.init's runtime env sets too")
    return out


def problems(files: dict[str, list[dict]], dc: DeployConfig, load: LoadConfig) -> list[str]:
    """Everything wrong with rendered manifests ({file name: documents}); empty when they deploy.
    ``load`` reads the job's training config (launch.config.load_config, see
    cluster/kuberay/training.py)."""
    docs = [d for ds in files.values() for d in ds]
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    out = [p for d in docs for p in schema_problems(d)]
    out += [f"{k}: exposes the cluster outside" for k in ("Service", "Ingress") if k in by_kind]
    pvcs = [d for d in by_kind.get("PersistentVolumeClaim", []) if d["metadata"]["name"] == dc.pvc]
    if not pvcs or "ReadWriteMany" not in pvcs[0]["spec"]["accessModes"]:
        out.append(f"PersistentVolumeClaim {dc.pvc}: missing or not ReadWriteMany")
    (cluster,), (job,) = by_kind["RayCluster"], by_kind["RayJob"]
    maps = [d for d in by_kind.get("ConfigMap", []) if d["metadata"]["name"] == f"{dc.name}-config"]
    if not maps or CONFIG_KEY not in maps[0].get("data", {}):
        return out + [f"ConfigMap {dc.name}-config with {CONFIG_KEY}: missing"]
    layer = maps[0]["data"][CONFIG_KEY]
    if job["spec"].get("rayClusterSpec") != cluster["spec"]:
        out.append("RayJob: its rayClusterSpec differs from raycluster.yaml's spec")
    ray_pin = [ln for ln in (REPO / "requirements-gpu.lock").read_text().splitlines()
               if ln.startswith("ray==")]
    if [f"ray=={cluster['spec']['rayVersion']}"] != ray_pin:
        out.append(f"RayCluster: rayVersion {cluster['spec']['rayVersion']}, the image has {ray_pin}")
    if [g["groupName"] for g in cluster["spec"]["workerGroupSpecs"]] != [g.value for g in Group]:
        out.append("RayCluster: worker groups must be rollout and learner")
    for spec in (cluster["spec"], job["spec"]["rayClusterSpec"]):
        out += pod_problems(spec, dc)
    # the config the RayJob's entrypoint runs, loaded once for both checks below
    cfg = deployed_config(dc, shlex.split(job["spec"]["entrypoint"])[2:], layer, load)
    return out + plan_problems(cluster["spec"], dc, cfg) + job_problems(job, dc, cfg)
