"""Two hosts on one machine: a Ray head and a worker node in two network namespaces joined by a
veth pair (10.77.0.1, 10.77.0.2), each node with its own temp dir. A second node on 127.0.0.2 would
not do: all of 127/8 is local to every process there, so a rendezvous bound to the wrong host
still works.

``launch/train.py`` runs with the learner on the worker node (a custom resource only that node
has) and the rollout, scorer and buffer on the head; mid-run the rollout actor's process is
killed, and the elastic path must replace it and re-form the weight-sync group across the nodes.
Then the same run through ``ray job submit`` (absolute shared paths), and a relative
``run.out_dir`` under ``ray job submit`` must be refused.

Needs root and iproute2 (``ip netns``); CI runs as root. Without them the tests are skipped,
saying why. Everything started here is stopped by pid (never ``ray stop``, which would kill every
Ray on the machine), then the namespaces are deleted (the veth pair goes with them).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError
from launch.checkpoint import missing_parts

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")
HEAD_IP, WORKER_IP = "10.77.0.1", "10.77.0.2"
GCS_PORT, DASHBOARD_PORT = 6379, 8265
# the learner asks for this; only the worker node has it
LEARNER_RESOURCE = "learner_node"
# small enough for a few-second step on 2 cores; a checkpoint every step
JOB = ["run.steps=4", "run.eval_problems=4", "run.prompts_per_step=2",
       "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12", "rollout.num_actors=1",
       "scorer.num_actors=1", "run.checkpoint_every=2", "correction.loss.entropy_coef=0.01",
       "cluster.learner_cpus=1", f"cluster.learner_resources={{{LEARNER_RESOURCE}: 1}}",
       "cluster.weight_sync_timeout_s=60", "cluster.placement_timeout_s=120"]


# ---- without namespaces: the rendezvous helpers, paths under job submit, complete checkpoints --

def test_the_serving_process_binds_its_own_address_and_keeps_the_socket():
    from cluster.rendezvous import interface_of, local_ip_toward, open_endpoint, take_endpoint
    from cluster.weight_sync import WeightReceiver, WeightSender

    ep = open_endpoint()  # outside Ray: loopback, the local default
    assert ep.host == "127.0.0.1" and ep.port > 0
    with pytest.raises(OSError):  # held: nothing else can take the port in between
        socket.create_server(("127.0.0.1", ep.port))
    assert local_ip_toward("127.0.0.1") == "127.0.0.1" and interface_of("127.0.0.1") == "lo"
    spec = [("w", (4,), torch.float32)]
    made = {}
    t = threading.Thread(target=lambda: made.update(s=WeightSender(
        ep.host, ep.port, 2, spec, timeout_s=20, listen_sock=take_endpoint(ep, *ep.address))))
    t.start()
    rx = WeightReceiver(ep.host, ep.port, 1, 2, spec, timeout_s=20)  # dials what it reported
    t.join()
    t = threading.Thread(target=lambda: made["s"].send([("w", torch.arange(4.0))], 3))
    t.start()
    version, got = rx.receive()
    t.join()
    assert version == 3 and got[0][1].tolist() == [0.0, 1.0, 2.0, 3.0]
    other = open_endpoint()
    assert take_endpoint(other, "127.0.0.1", other.port + 1) is None  # not its address: closed
    socket.create_server(("127.0.0.1", other.port)).close()


def test_relative_paths_under_ray_job_submit_are_refused():
    from launch.config import load_config
    from launch.preflight import JOB_SUBMIT_ENV, check_shared_paths

    job = {JOB_SUBMIT_ENV: "{}"}
    check_shared_paths(load_config(["run.out_dir=runs"]), environ={})  # a plain local run
    check_shared_paths(load_config(["run.out_dir=/shared/runs", "rollout.model_path=/m"]), job)
    for key, value in (("run.out_dir", "runs"), ("rollout.model_path", ".cache/models/m"),
                       ("buffer.root", "buf")):
        absolute = ["run.out_dir=/shared/runs", "rollout.model_path=/m"]
        with pytest.raises(ConfigError, match=rf"'{key}': got '{value}'; allowed: an absolute "
                                              r"path on storage every node shares: under `ray "
                                              r"job submit` each node"):
            check_shared_paths(load_config(absolute + [f"{key}={value}"]), job)


def test_a_checkpoint_missing_the_learners_parts_is_refused(tmp_path):
    from launch.checkpoint import STATE_FILE, find_checkpoint

    run = tmp_path / "run"
    half = run / "checkpoints" / "step-000002"  # what the head kept when the learner wrote
    (half / "buffer").mkdir(parents=True)       # its parts on its own node
    (half / STATE_FILE).write_text("{}")
    (half / "config.yaml").write_text("")
    assert missing_parts(half) == ["deepspeed/latest", "hf/config.json"]
    with pytest.raises(ConfigError, match=r"a complete checkpoint; this one lacks "
                                          r"\['deepspeed/latest', 'hf/config.json'\].*shares"):
        find_checkpoint(str(half))
    with pytest.raises(ConfigError, match="complete checkpoints/step-"):
        find_checkpoint(str(run))  # a run folder: a half checkpoint is not taken either
    (half / "hf").mkdir()
    (half / "hf" / "config.json").write_text("{}")
    (half / "deepspeed").mkdir()
    (half / "deepspeed" / "latest").write_text("v2")
    assert missing_parts(half) == ["deepspeed/v2"]  # the tag it names is not there
    (half / "deepspeed" / "v2").mkdir()
    assert find_checkpoint(str(run)) == half


# ---- two hosts ----------------------------------------------------------------------------------

@dataclass
class TwoHosts:
    head_ns: str
    worker_ns: str
    env: dict        # environment of every process started in the namespaces
    tmp: Path
    ray_tmp: Path    # the nodes' temp dirs (short: Ray's socket paths)

    def run(self, ns: str, *cmd: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", ns, *cmd], env=self.env, text=True,
                              capture_output=True, timeout=timeout, **kw)

    def popen(self, ns: str, *cmd: str, out: Path) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=self.env, text=True,
                                stdout=out.open("w"), stderr=subprocess.STDOUT)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _procs(ns: str, title: str) -> list[int]:
    """Pids in ``ns`` whose process title starts with ``title`` (Ray names actor processes
    ``ray::<Class>``)."""
    return [p for p in _ns_pids(ns) if _cmdline(p).startswith(title)]


def _stop_namespace(ns: str) -> None:
    """SIGTERM, then SIGKILL, every process in ``ns`` (all of them were started by this test),
    then delete it."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for pid in _ns_pids(ns):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _ns_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.2)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _make_namespaces(head: str, worker: str, tag: str) -> None:
    va, vb = f"{tag}a", f"{tag}b"  # interface names: at most 15 characters
    for ns in (head, worker):
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")  # Ray's own processes talk over loopback too
    _ip("link", "add", va, "type", "veth", "peer", "name", vb)
    _ip("link", "set", va, "netns", head)
    _ip("link", "set", vb, "netns", worker)
    _ip("-n", head, "addr", "add", f"{HEAD_IP}/24", "dev", va)
    _ip("-n", worker, "addr", "add", f"{WORKER_IP}/24", "dev", vb)
    _ip("-n", head, "link", "set", va, "up")
    _ip("-n", worker, "link", "set", vb, "up")


def _why_no_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` to create network namespaces (two hosts on one machine)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces and a veth pair (CI runs as root)"
    return None


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    why = _why_no_namespaces()
    if why:
        pytest.skip(why)
    tag = f"srl{os.getpid() % 100000}"
    head, worker = f"{tag}-head", f"{tag}-worker"
    try:
        _make_namespaces(head, worker, tag)
    except subprocess.CalledProcessError as e:
        for ns in (head, worker):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces / a veth pair here: "
                    f"`{' '.join(e.cmd)}` said {e.stderr.strip()!r}")
    tmp = tmp_path_factory.mktemp("two-hosts")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled",
           "HOME": str(tmp / "home"), "RAY_USAGE_STATS_ENABLED": "0",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  str(REPO / ".cache" / "torch_extensions"))}
    env.pop("RAY_ADDRESS", None)
    # a local Ray started earlier in this pytest process (cluster.ray_setup._loopback_only) sets
    # this to 0 in os.environ, which makes `ray start --address` refuse to join a cluster
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    for var in ("GLOO_SOCKET_IFNAME", "SPARSE_RL_GLOO_IFNAME_AUTO"):  # set by loopback groups
        env.pop(var, None)
    # Ray's unix sockets live under the temp dir and must stay below ~107 characters
    ray_tmp = Path(tempfile.mkdtemp(prefix="srl-", dir="/tmp"))
    hosts = TwoHosts(head, worker, env, tmp, ray_tmp)
    try:
        _start_ray(hosts)
        yield hosts
    finally:
        for ns in (head, worker):
            _stop_namespace(ns)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _start_ray(h: TwoHosts) -> None:
    """The head (GCS, dashboard with the job server) in one namespace, the worker in the other,
    each with its own temp dir; these are the commands docs/DEPLOY.md shows."""
    common = ["--disable-usage-stats", "--object-store-memory", str(100 << 20)]
    head = h.run(h.head_ns, RAY, "start", "--head", f"--node-ip-address={HEAD_IP}",
                 f"--port={GCS_PORT}", "--num-cpus=2", f"--temp-dir={h.ray_tmp / 'head'}",
                 "--include-dashboard=true", f"--dashboard-host={HEAD_IP}",
                 f"--dashboard-port={DASHBOARD_PORT}", *common)
    assert head.returncode == 0, head.stdout + head.stderr
    worker = h.run(h.worker_ns, RAY, "start", f"--address={HEAD_IP}:{GCS_PORT}",
                   f"--node-ip-address={WORKER_IP}", "--num-cpus=1",
                   f"--resources={json.dumps({LEARNER_RESOURCE: 1})}",
                   f"--temp-dir={h.ray_tmp / 'worker'}", *common)
    assert worker.returncode == 0, worker.stdout + worker.stderr
    _wait_for_nodes(h, 2)


def _wait_for_nodes(h: TwoHosts, n: int, timeout: float = 60.0) -> None:
    # the head's address, never 'auto': 'auto' reads the machine's current-cluster file, which
    # another Ray on this machine (a training run beside the suite) points at its own cluster, out
    # of this namespace's reach: the probe then hung until its 300 s timeout
    probe = (f"import ray; ray.init(address='{HEAD_IP}:{GCS_PORT}', log_to_driver=False); "
             "print(sum(1 for x in ray.nodes() if x['Alive']))")
    deadline = time.monotonic() + timeout
    while True:
        out = h.run(h.head_ns, sys.executable, "-c", probe)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        assert time.monotonic() < deadline, f"{n} Ray nodes never came up: {out.stdout}{out.stderr}"
        time.sleep(1.0)


def _run_dir(out_dir: Path) -> Path:
    runs = sorted(p for p in out_dir.iterdir() if p.is_dir())
    assert len(runs) == 1, runs
    return runs[0]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_learner_on_another_host_and_a_killed_rollout_actor(two_hosts, tiny_model):
    """The learner serves both groups from the worker node; after the rollout actor's process is
    killed mid-run, it is replaced and the group re-forms across the nodes; every broadcast after
    that leaves every actor with exactly the learner's weights."""
    h = two_hosts
    out_dir = h.tmp / "runs-driver"
    log = h.tmp / "driver.log"
    driver = h.popen(h.head_ns, sys.executable, str(REPO / "launch/train.py"),
                     f"cluster.address={HEAD_IP}:{GCS_PORT}", f"rollout.model_path={tiny_model}",
                     f"run.out_dir={out_dir}", *JOB, out=log)
    try:
        killed, learner_pids = _kill_rollout_after_first_step(h, out_dir, driver)
        rc = driver.wait(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()
    text = log.read_text()
    assert rc == 0, text[-6000:]
    assert learner_pids, "no learner process on the worker node"
    assert killed, f"the run ended before its rollout actor could be killed:\n{text[-3000:]}"
    # found lost by whichever call reached it first: its rollout, or a weight broadcast
    elastic = [line for line in text.splitlines() if line.startswith("[elastic]")]
    assert elastic and "rollout actor 0: dead, replaced" in elastic[0], text[-3000:]
    run_dir = _run_dir(out_dir)
    steps = [m for m in _metrics(run_dir) if "weights/max_rel_diff" in m]
    assert [m["step"] for m in steps][-4:] == [1, 2, 3, 4]
    assert all(m["weights/max_rel_diff"] == 0.0 for m in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["version"] == 4
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-000002", "step-000004"]
    assert all(missing_parts(c) == [] for c in ckpts)


def _kill_rollout_after_first_step(h: TwoHosts, out_dir: Path, driver) -> tuple[bool, list]:
    """Once step 1 is logged, SIGKILL the rollout actor's process on the head. Returns whether it
    was killed and the learner processes seen on the worker node."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and driver.poll() is None:
        metrics = next(out_dir.glob("*/metrics.jsonl"), None) if out_dir.exists() else None
        if metrics and any(json.loads(x).get("step") == 1 and "loss" in json.loads(x)
                           for x in metrics.read_text().splitlines()):
            learners = _procs(h.worker_ns, "ray::Learner")
            assert not _procs(h.head_ns, "ray::Learner"), "a learner ran on the head"
            rollout = _procs(h.head_ns, "ray::RolloutActor")
            assert rollout and not _procs(h.worker_ns, "ray::RolloutActor")
            for pid in rollout:
                os.kill(pid, signal.SIGKILL)
            return True, learners
        time.sleep(0.2)
    return False, []


@pytest.mark.slow
def test_ray_job_submit_with_absolute_shared_paths(two_hosts, tiny_model):
    """The same job through the head's job server: the driver runs in the head's unpacked copy of
    the working dir; model and run.out_dir are absolute paths every node sees."""
    h = two_hosts
    out_dir = h.tmp / "runs-job"
    job = _submit(h, f"rollout.model_path={tiny_model}", f"run.out_dir={out_dir}", "run.steps=2",
                  *JOB[1:])
    assert job.returncode == 0, job.stdout[-6000:] + job.stderr[-2000:]
    assert "succeeded" in job.stdout
    run_dir = _run_dir(out_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["version"] == 2
    ckpt = run_dir / "checkpoints" / "step-000002"
    assert missing_parts(ckpt) == []


@pytest.mark.slow
def test_ray_job_submit_refuses_a_relative_out_dir(two_hosts, tiny_model):
    job = _submit(two_hosts, f"rollout.model_path={tiny_model}", "run.out_dir=runs", *JOB)
    assert job.returncode != 0
    assert "config key 'run.out_dir': got 'runs'; allowed: an absolute path on storage every " \
           "node shares" in job.stdout + job.stderr


def _submit(h: TwoHosts, *overrides: str) -> subprocess.CompletedProcess:
    """``ray job submit`` from the head's namespace, the working dir uploaded (caches, runs and
    git data left out), ``cluster.address=auto``."""
    runtime_env = {"excludes": [".cache", ".venv", "runs", ".git", "*.pyc"]}
    return h.run(h.head_ns, RAY, "job", "submit", f"--address=http://{HEAD_IP}:{DASHBOARD_PORT}",
                 f"--working-dir={REPO}", f"--runtime-env-json={json.dumps(runtime_env)}", "--",
                 sys.executable, "launch/train.py", "cluster.address=auto", *overrides,
                 timeout=400)


def test_gloo_interface_chosen_per_host_unless_the_user_set_one(monkeypatch):
    """A loopback group formed earlier in a process (or its parent) must not pin later groups to
    ``lo``; an interface the user set is always kept."""
    from cluster.rendezvous import GLOO_AUTO, GLOO_IFNAME, use_interface_toward

    monkeypatch.delenv(GLOO_IFNAME, raising=False)
    monkeypatch.delenv(GLOO_AUTO, raising=False)
    assert use_interface_toward("127.0.0.1") == "lo"
    assert os.environ[GLOO_IFNAME] == os.environ[GLOO_AUTO] == "lo"
    monkeypatch.setattr("cluster.rendezvous.interface_of", lambda ip: "veth-test")
    monkeypatch.setattr("cluster.rendezvous.local_ip_toward", lambda host: "10.77.0.1")
    assert use_interface_toward("10.77.0.2") == "veth-test"  # recomputed: it was ours
    monkeypatch.setenv(GLOO_IFNAME, "eth-user")
    assert use_interface_toward("10.77.0.2") == "eth-user"
    assert os.environ[GLOO_IFNAME] == "eth-user"
