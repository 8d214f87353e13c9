"""The KubeRay manifests (cluster/kuberay/): rendered from deploy.yaml and the GPU preset it names
(no drift), valid against the KubeRay 1.7.0 CRDs (tests/data/kuberay-1.7.0), and deployable: GPU
image on GPU groups, a ReadWriteMany volume in every pod, absolute paths on it, pools that fit the
groups as cluster/resources.py plans them, nothing exposed outside the cluster (issue 16)."""
from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml

from cluster.kuberay import render, validate
from cluster.kuberay.options import DeployConfig, load_deploy
from common.errors import ConfigError
from launch.config import load_config
from launch.kuberay import main

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "cluster" / "kuberay" / "deploy.yaml"
DOCS = REPO / "docs" / "DEPLOY.md"
CHECK = "python -m launch.kuberay --check"  # the command docs/DEPLOY.md gives


@pytest.fixture(scope="module")
def dc() -> DeployConfig:
    return load_deploy(DEPLOY, [])


@pytest.fixture(scope="module")
def files(dc) -> dict[str, list[dict]]:
    return {name: list(yaml.safe_load_all((REPO / "cluster/kuberay" / name).read_text()))
            for name in render.FILES}


def _kind(files, kind):
    return [d for ds in files.values() for d in ds if d["kind"] == kind]


def test_committed_manifests_are_rendered_and_valid(capsys):
    assert main(shlex.split(CHECK)[3:]) == 0, capsys.readouterr().out
    assert "valid" in capsys.readouterr().out


def test_deploy_doc_gives_the_commands_the_tests_run():
    text = DOCS.read_text()
    assert CHECK in text and "python -m launch.kuberay\n" in text
    assert f"--version {validate.KUBERAY_VERSION}" in text  # the operator the schema comes from
    for name in render.FILES:
        assert f"kubectl apply -f cluster/kuberay/{name}" in text


def test_schema_data_names_its_source_and_version():
    import hashlib

    source = (validate.CRD_DIR / "SOURCE.md").read_text()
    assert f"v{validate.KUBERAY_VERSION}" in source
    for name in validate.CRD_FILES.values():
        digest = hashlib.sha256((validate.CRD_DIR / name).read_bytes()).hexdigest()
        assert f"helm-chart/kuberay-operator/crds/{name}" in source and digest in source


def test_schema_rejects_misspelt_and_mistyped_fields(files):
    (cluster,) = _kind(files, "RayCluster")
    assert validate.schema_problems(cluster) == []
    bad = copy.deepcopy(cluster)
    bad["spec"]["headGroupSpec"]["serviceTpye"] = "ClusterIP"
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    found = "\n".join(validate.schema_problems(bad))
    assert "serviceTpye" in found and "workerGroupSpecs.0.replicas" in found
    (job,) = _kind(files, "RayJob")
    bad = copy.deepcopy(job)
    bad["spec"]["shutdownAfterJobFinish"] = True
    assert any("shutdownAfterJobFinish" in p for p in validate.schema_problems(bad))


def test_nothing_is_exposed_outside_the_cluster(files):
    assert not _kind(files, "Service") and not _kind(files, "Ingress")
    specs = [d["spec"] for d in _kind(files, "RayCluster")] + \
            [d["spec"]["rayClusterSpec"] for d in _kind(files, "RayJob")]
    for spec in specs:
        head = spec["headGroupSpec"]
        assert head["serviceType"] == "ClusterIP" and head["enableIngress"] is False
        assert "headService" not in head
        for tmpl in [head["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
            assert not tmpl["spec"].get("hostNetwork")
            for c in tmpl["spec"]["containers"]:
                assert all("hostPort" not in p for p in c.get("ports", []))


def test_job_runs_the_preset_on_the_volume_and_resumes(dc, files):
    (job,) = _kind(files, "RayJob")
    (overlay,) = _kind(files, "ConfigMap")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "/workspace/launch/train.py"] and "resume=latest" in argv
    assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["backoffLimit"] >= 1
    assert "runtimeEnvYAML" not in job["spec"]  # ray.init's runtime env sets RAY_AUTH_MODE
    cfg = render.deployed_config(dc, argv[2:], overlay["data"][render.CONFIG_KEY], load_config)
    preset = load_config(["--config", str(REPO / dc.preset)])
    assert cfg.rollout.model_path == "/mnt/sparse-rl/models/Qwen2.5-1.5B"
    assert cfg.run.out_dir == "/mnt/sparse-rl/runs" and cfg.cluster.address == "auto"
    assert cfg.task.path == "/mnt/sparse-rl/data/math_level3to5_train.jsonl"
    # the eval sets are the preset's, only moved onto the volume
    assert [(s.path, s.prompt_template) for s in cfg.task.eval_sets] == \
        [(f"/mnt/sparse-rl/data/{Path(s.path).name}", s.prompt_template) for s in preset.task.eval_sets]
    assert cfg.learner == preset.learner and cfg.rollout.kv == preset.rollout.kv


def test_pools_fit_the_groups_as_planned(dc, files):
    """One learner per GPU: a learner pod offers learner_pool = its GPUs, each learner and scorer
    asks 1 (and 1 GPU); the rollout pods likewise; the buffer only fits the head."""
    from cluster.resources import plan, shortfalls

    (cluster,) = _kind(files, "RayCluster")
    (overlay,) = _kind(files, "ConfigMap")
    (job,) = _kind(files, "RayJob")
    cfg = render.deployed_config(dc, shlex.split(job["spec"]["entrypoint"])[2:],
                                 overlay["data"][render.CONFIG_KEY], load_config)
    pools = plan(cfg)
    assert pools["learner"] == (2, {"CPU": 2.0, "GPU": 1.0, "learner_pool": 1.0})
    assert pools["scorer"] == (2, {"CPU": 2.0, "GPU": 1.0, "learner_pool": 1.0})
    assert pools["rollout"] == (4, {"CPU": 2.0, "GPU": 1.0, "rollout_pool": 1.0})
    assert pools["buffer"] == (1, {"CPU": 0.1, "buffer_pool": 1.0})
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert groups["learner"]["resources"] == {"learner_pool": "4"}
    assert groups["learner"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == "4"
    assert cluster["spec"]["headGroupSpec"]["resources"] == {"CPU": "1", "buffer_pool": "1"}
    assert shortfalls(cfg, validate.cluster_totals(cluster["spec"])) == []
    # one pod fewer on the learner side and the plan no longer fits
    small = copy.deepcopy(cluster["spec"])
    small["workerGroupSpecs"][1]["replicas"] = 0
    assert [s[1] for s in shortfalls(cfg, validate.cluster_totals(small))] == ["GPU", "learner_pool"]


BREAKS = {
    "NodePort": (lambda f: f["raycluster.yaml"][0]["spec"]["headGroupSpec"].update(
        serviceType="NodePort"), "must stay ClusterIP"),
    "hostPort": (lambda f: f["raycluster.yaml"][0]["spec"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]["ports"][0].update(hostPort=6379), "hostPort"),
    "no volume": (lambda f: f["raycluster.yaml"][0]["spec"]["workerGroupSpecs"][1]["template"][
        "spec"]["containers"][0]["volumeMounts"].pop(0), "learner: the volume"),
    "cpu image": (lambda f: f["raycluster.yaml"][0]["spec"]["workerGroupSpecs"][0]["template"][
        "spec"]["containers"][0].update(image="registry.example.com/sparse-rl:cpu-0.1.0"),
        "not the pinned GPU image"),
    "not RWX": (lambda f: f["base.yaml"][0]["spec"].update(accessModes=["ReadWriteOnce"]),
                "not ReadWriteMany"),
    "kept cluster": (lambda f: f["rayjob.yaml"][0]["spec"].update(shutdownAfterJobFinishes=False),
                     "shutdownAfterJobFinishes"),
    "auth env": (lambda f: f["rayjob.yaml"][0]["spec"].update(
        runtimeEnvYAML="env_vars:\n  RAY_AUTH_MODE: disabled\n"), "RAY_AUTH_MODE"),
    "pool on two groups": (lambda f: f["raycluster.yaml"][0]["spec"]["workerGroupSpecs"][0][
        "resources"].update(learner_pool="4"), "offered by ['learner', 'rollout']"),
    "drift": (lambda f: f["rayjob.yaml"][0]["spec"]["rayClusterSpec"].update(rayVersion="2.59.0"),
              "rayClusterSpec differs"),
}


@pytest.mark.parametrize("what", list(BREAKS))
def test_validation_names_what_breaks_a_deployment(dc, files, what):
    assert validate.problems(files, dc, load_config) == []
    broken = copy.deepcopy(files)
    change, message = BREAKS[what]
    change(broken)
    assert any(message in p for p in validate.problems(broken, dc, load_config)), validate.problems(broken, dc, load_config)


@pytest.mark.parametrize("overrides, key", [
    (["overrides=[cluster.scorer_gpus=0.5]"], "cluster.scorer_gpus"),  # two NCCL ranks on a GPU
    (["overrides=[cluster.rollout_gpus=0]"], "cluster.rollout_gpus"),
    (["learner.gpus_per_pod=2"], "learner.replicas"),   # 4 GPUs of learners + scorers
    (["rollout.cpus_per_pod=4"], "rollout.cpus_per_pod"),  # 4 actors x 2 CPUs
    (["image=registry.example.com/sparse-rl:latest"], "image"),
    (["image=registry.example.com/sparse-rl"], "image"),
    (["mount=mnt/data"], "mount"),
    (["rollout.replicas=9"], "rollout.replicas"),       # above max_replicas
    (["rollout.gpu_per_pod=2"], "rollout.gpu_per_pod"),  # unknown key
])
def test_bad_deployment_names_its_key(overrides, key, capsys):
    with pytest.raises(ConfigError) as err:
        render.manifests(load_deploy(DEPLOY, overrides), load_config)
    assert f"'{key}'" in str(err.value)
    assert main(overrides + ["--check"]) == 2
    assert key in capsys.readouterr().err


@pytest.mark.parametrize("preset, sizes", [
    ("qwen2.5-3b-math.yaml", []),
    ("qwen2.5-7b-math.yaml", ["rollout.replicas=2", "learner.replicas=2", "learner.max_replicas=2"]),
    ("llama3.2-1b-instruct-math.yaml", []),
])
def test_every_gpu_preset_renders_valid_manifests(preset, sizes):
    dc = load_deploy(DEPLOY, [f"preset=launch/configs/{preset}", *sizes])
    docs = {n: list(yaml.safe_load_all(t)) for n, t in render.render(dc, load_config).items()}
    assert validate.problems(docs, dc, load_config) == []
