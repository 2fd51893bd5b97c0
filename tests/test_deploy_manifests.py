"""deploy/'s Kubernetes manifests, checked offline (no cluster on CI's machines).

1. Every document validates against its kind's schema in deploy/schemas/ (the upstream CRDs of
   KServe and the training operator, Kubernetes' own for the core kinds; deploy/schemas/refresh.py
   says how they were made).
2. Every command that runs our code parses with our real parsers, in the environment Kubernetes
   would give it: values from the ConfigMaps and Secrets (secrets.example.yaml) the manifests name,
   `$(VAR)` expanded as the kubelet does, KServe's `{{.Name}}` filled in and the InferenceService's
   args appended to its runtime's (as KServe merges them), torchrun's settings from the PET_*
   variables the training operator sets. So a renamed flag, config key or environment variable turns
   this red, not a pod in a cluster.
3. What the manifests say about our server agrees with it: ports, probe paths, the model it follows.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import io
import json
import math
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import REPO

DEPLOY = REPO / "deploy"
SCHEMAS = DEPLOY / "schemas"
# deploy/ and the training run without the operator
KUSTOMIZATIONS = [
    DEPLOY,
    DEPLOY / "indexed-job",
]
# Manifests applied by hand rather than by a kustomization (README.md says why and how).
APPLIED_BY_HAND = {"secrets.example.yaml", "publish-job.yaml"}


class ManifestError(AssertionError):
    """A manifest that would not work; the message names the document and what is wrong."""


# --- reading and validating -----------------------------------------------------------------------


def load_documents() -> list[tuple[str, dict]]:
    """(path under deploy/, document) for every resource under deploy/."""
    docs = []
    for folder in KUSTOMIZATIONS:
        for path in sorted(folder.glob("*.yaml")):
            if path.name != "kustomization.yaml":
                docs += [
                    (str(path.relative_to(DEPLOY)), doc)
                    for doc in yaml.safe_load_all(path.read_text())
                    if doc
                ]
    return docs


def in_file(docs, file: str) -> list[tuple[str, dict]]:
    return [(f, d) for f, d in docs if f == file]


def schema_file(doc: dict) -> Path:
    """deploy/schemas/<group>_<version>_<kind>.json (core group: <version>_<kind>.json)."""
    return SCHEMAS / f"{doc['apiVersion'].replace('/', '_')}_{doc['kind'].lower()}.json"


@cache
def validator(path: Path) -> jsonschema.protocols.Validator:
    return jsonschema.Draft202012Validator(json.loads(path.read_text()))


def schema_errors(doc: dict) -> list[str]:
    path = schema_file(doc)
    if not path.exists():
        raise ManifestError(
            f"no schema for {doc.get('apiVersion')} {doc.get('kind')}: expected {path.name} in "
            f"deploy/schemas/ (add the kind to deploy/schemas/refresh.py and run it)"
        )
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in validator(path).iter_errors(doc)
    ]


def named(docs, kind: str, name: str | None = None) -> dict:
    found = [
        d
        for _, d in docs
        if d["kind"] == kind and (name is None or d["metadata"].get("name") == name)
    ]
    if len(found) != 1:
        raise ManifestError(
            f"expected one {kind}{' ' + name if name else ''} in deploy/, found {len(found)}"
        )
    return found[0]


def containers(doc: dict) -> list[dict]:
    """Every container and init container anywhere in a document."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    found.extend(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(doc)
    return found


# --- what Kubernetes would do with a container ----------------------------------------------------


def container_env(container: dict, docs, field_values: dict | None = None) -> dict[str, str]:
    """The container's environment as the kubelet builds it: literal values, ConfigMap and Secret
    keys (the Secrets of secrets.example.yaml), downward-API fields from `field_values`, CPU
    requests rounded up."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        name, source = entry["name"], entry.get("valueFrom")
        if source is None:
            env[name] = expand(str(entry.get("value", "")), env)
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind, ref = (
                ("ConfigMap", source["configMapKeyRef"])
                if "configMapKeyRef" in source
                else ("Secret", source["secretKeyRef"])
            )
            holder = named(docs, kind, ref["name"])
            # a Secret's `data` is base64, its `stringData` plain
            encoded = kind == "Secret"
            data = {
                **{
                    k: base64.b64decode(v).decode() if encoded else v
                    for k, v in holder.get("data", {}).items()
                },
                **holder.get("stringData", {}),
            }
            if ref["key"] not in data:
                raise ManifestError(
                    f"{name}: {kind} {ref['name']} has no key {ref['key']!r} (it has {sorted(data)})"
                )
            env[name] = data[ref["key"]]
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if path not in (field_values or {}):
                raise ManifestError(
                    f"{name}: fieldRef {path} is not one this check knows a value for"
                )
            env[name] = field_values[path]
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            if ref["resource"] not in ("requests.cpu", "limits.cpu"):
                raise ManifestError(
                    f"{name}: resourceFieldRef {ref['resource']}: this check knows only CPU counts"
                )
            section, resource = ref["resource"].split(".")
            quantity = str(container["resources"][section][resource])
            cpus = int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
            env[name] = str(math.ceil(cpus / float(ref.get("divisor", "1"))))
        else:
            raise ManifestError(f"{name}: a valueFrom this check does not know: {sorted(source)}")
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """`$(VAR)` in a command, argument or env value, as Kubernetes expands it: a variable defined
    earlier in the container's env is replaced, `$$` escapes, anything else is left as it is (and
    silently wrong in a pod: `unexpanded` finds it)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def command_line(container: dict, env: dict[str, str]) -> list[str]:
    line = [expand(part, env) for part in container.get("command", []) + container.get("args", [])]
    unexpanded = [part for part in line if re.search(r"\$\(|\{\{", part)]
    if unexpanded:
        raise ManifestError(
            f"container {container['name']}: {unexpanded} would reach the process unexpanded: "
            f"define the variable in the container's env (its env: {sorted(env)})"
        )
    return line


@contextlib.contextmanager
def environment(
    monkeypatch, env: dict[str, str], clear_prefixes=("TRAINSERVE_", "PET_", "MLFLOW_", "AWS_")
):
    """Exactly this environment for our code, as in the container (nothing of ours leaks in from the
    test's)."""
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith(clear_prefixes)]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        yield


def parse(
    parser: argparse.ArgumentParser, argv: list[str], intermixed: bool = False
) -> argparse.Namespace:
    """argparse's answer, or ManifestError with its own message (instead of SystemExit)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_intermixed_args(argv) if intermixed else parser.parse_args(argv)
    except SystemExit:
        said = [line for line in stderr.getvalue().splitlines() if "error:" in line] or [
            stderr.getvalue()
        ]
        raise ManifestError(f"{parser.prog} refuses {argv}: {said[-1]}") from None


def stage_parser(module) -> argparse.ArgumentParser:
    """The parser `pipeline <stage>` builds from the stage module (as pipeline.cli does)."""
    parser = argparse.ArgumentParser(prog=f"pipeline {module.__name__.rsplit('.', 1)[1]}")
    module.add_arguments(parser)
    return parser


# --- the checks, each on a list of documents (so a broken copy can be checked too) ----------------


def check_schemas(docs) -> None:
    problems = [
        f"{file}: {doc['kind']} {doc['metadata'].get('name') or doc['metadata'].get('generateName')}: "
        f"{error}"
        for file, doc in docs
        for error in schema_errors(doc)
    ]
    if problems:
        raise ManifestError("\n".join(problems[:20]))


def operator_env(job: dict) -> dict[str, str]:
    """The PET_* variables the training operator (v1.9, pkg/controller.v1/pytorch/elastic.go and
    envvar.go) sets in an elastic PyTorchJob's containers; torchrun reads each as the default of its
    flag."""
    spec, policy = job["spec"], job["spec"]["elasticPolicy"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    pytorch = next(c for c in worker["template"]["spec"]["containers"] if c["name"] == "pytorch")
    port = policy.get("rdzvPort") or next(
        p["containerPort"] for p in pytorch.get("ports", []) if p["name"] == "pytorchjob-port"
    )
    env = {
        "PET_RDZV_ENDPOINT": f"{policy.get('rdzvHost', job['metadata']['name'] + '-worker-0')}:{port}",
        "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}"
        if "minReplicas" in policy
        else str(worker["replicas"]),
    }
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "nprocPerNode" in spec:
        env["PET_NPROC_PER_NODE"] = spec["nprocPerNode"]
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    return env


def launch_training(where: str, line: list[str], env: dict, monkeypatch, node_counts) -> tuple:
    """(torchrun's launch config, pipeline train's args, the run's config) for a container that runs
    `torchrun ... -m pipeline.train ...` with this environment; pipeline train must accept the run
    at every number of nodes in `node_counts`."""
    import torch.distributed.run as torchrun

    from pipeline import train
    from pipeline.config import ConfigError, check_runtime, load_config

    if line[0] != "torchrun":
        raise ManifestError(f"{where}: the container runs {line[0]!r}, not torchrun")
    with environment(monkeypatch, {**env, "OMP_NUM_THREADS": "1"}):
        parser = torchrun.get_args_parser()
        # not this process's name
        parser.prog = "torchrun"
        launch, _, worker_argv = torchrun.config_from_args(parse(parser, line[1:]))
        if worker_argv[:3] != ["-u", "-m", "pipeline.train"]:
            raise ManifestError(f"{where}: torchrun runs {worker_argv[:3]}, not -m pipeline.train")
        args = parse(stage_parser(train), worker_argv[3:], intermixed=True)
        try:
            cfg = load_config(args.config, args.overrides)
            for nodes in node_counts:
                check_runtime(
                    cfg,
                    nodes * launch.nproc_per_node,
                    cuda_available=False,
                    local_world_size=launch.nproc_per_node,
                )
        except ConfigError as exc:
            raise ManifestError(f"{where}: pipeline train would refuse: {exc}") from None
    return launch, args, cfg


def check_gpus(where: str, container: dict, nproc_per_node: int) -> None:
    gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
    if gpus and gpus != nproc_per_node:
        raise ManifestError(
            f"{where}: {nproc_per_node} processes per pod but {gpus} GPUs (one per rank)"
        )


def check_training_job(docs, monkeypatch) -> dict:
    """The PyTorchJob's pods run `torchrun ... -m pipeline.train`, elastic within what
    `pipeline train` supports."""
    job = named(docs, "PyTorchJob")
    name, spec = job["metadata"]["name"], job["spec"]
    where = f"PyTorchJob {name}"
    container = next(
        c
        for c in spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
        if c["name"] == "pytorch"
    )
    env = container_env(
        container, docs, {"metadata.labels['training.kubeflow.org/job-name']": name}
    )
    policy = spec["elasticPolicy"]
    launch, args, cfg = launch_training(
        where,
        command_line(container, env),
        {**env, **operator_env(job)},
        monkeypatch,
        range(policy["minReplicas"], policy["maxReplicas"] + 1),
    )
    check_gpus(where, container, launch.nproc_per_node)
    return {"launch": launch, "args": args, "cfg": cfg, "env": env, "job": job}


def check_indexed_training_job(docs, monkeypatch) -> dict:
    """The Indexed Job's pods run the same, the rendezvous endpoint being pod 0's full DNS name
    under the headless Service (see the manifest for why the full name)."""
    own = in_file(docs, "indexed-job/train-indexed-job.yaml")
    job, service = named(own, "Job"), named(own, "Service")
    name, spec, pod = job["metadata"]["name"], job["spec"], job["spec"]["template"]["spec"]
    where = f"Job {name}"
    namespace = yaml.safe_load((DEPLOY / "indexed-job" / "kustomization.yaml").read_text())[
        "namespace"
    ]
    (container,) = pod["containers"]
    env = container_env(
        container,
        docs,
        {"metadata.labels['batch.kubernetes.io/job-name']": name, "metadata.namespace": namespace},
    )
    launch, args, cfg = launch_training(
        where, command_line(container, env), env, monkeypatch, [spec["completions"]]
    )
    check_gpus(where, container, launch.nproc_per_node)
    if (
        spec.get("completionMode") != "Indexed"
        or not spec["completions"] == spec["parallelism"] == launch.min_nodes == launch.max_nodes
    ):
        raise ManifestError(
            f"{where}: an Indexed Job whose completions = parallelism = torchrun's --nnodes "
            f"(got {spec.get('completionMode')}, {spec['completions']}, {spec['parallelism']}, "
            f"{launch.min_nodes}:{launch.max_nodes})"
        )
    if (
        pod.get("subdomain") != service["metadata"]["name"]
        or service["spec"].get("clusterIP") != "None"
        or not service["spec"].get("publishNotReadyAddresses")
        or service["spec"]["selector"] != {"batch.kubernetes.io/job-name": name}
    ):
        raise ManifestError(
            f"{where}: its pods need DNS names before they are ready: a headless Service (clusterIP "
            f"None, publishNotReadyAddresses) selecting the job's pods, named as the pods' subdomain"
        )
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "rendezvous")
    endpoint = f"{name}-0.{service['metadata']['name']}.{namespace}.svc.cluster.local:{port}"
    if launch.rdzv_backend != "c10d" or launch.rdzv_endpoint != endpoint:
        raise ManifestError(
            f"{where}: rendezvous {launch.rdzv_backend} at {launch.rdzv_endpoint}; want c10d at "
            f"pod 0's full name {endpoint}"
        )
    return {"launch": launch, "args": args, "cfg": cfg, "env": env, "job": job}


def served_container(docs) -> tuple[dict, dict, dict]:
    """(InferenceService, ServingRuntime, the predictor's container as KServe builds it: the
    runtime's container with the InferenceService's env merged by name and its args appended,
    `{{.Name}}` filled in)."""
    isvc = named(docs, "InferenceService")
    model = isvc["spec"]["predictor"]["model"]
    runtime = named(docs, "ServingRuntime", model["runtime"])
    formats = [f["name"] for f in runtime["spec"]["supportedModelFormats"]]
    if model["modelFormat"]["name"] not in formats:
        raise ManifestError(
            f"InferenceService {isvc['metadata']['name']}: format {model['modelFormat']['name']} "
            f"is not among runtime {model['runtime']}'s {formats}"
        )
    if model.get("protocolVersion", "v1") not in runtime["spec"].get("protocolVersions", ["v1"]):
        raise ManifestError(
            f"InferenceService {isvc['metadata']['name']}: protocol {model.get('protocolVersion')} "
            f"is not among runtime {model['runtime']}'s {runtime['spec'].get('protocolVersions')}"
        )
    base = next(c for c in runtime["spec"]["containers"] if c["name"] == "kserve-container")
    merged = copy.deepcopy(base)
    merged["args"] = base.get("args", []) + model.get("args", [])
    merged["env"] = [
        e for e in base.get("env", []) if e["name"] not in {m["name"] for m in model.get("env", [])}
    ] + model.get("env", [])
    text = json.dumps(merged)
    namespace = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["namespace"]
    for field, value in (("Name", isvc["metadata"]["name"]), ("Namespace", namespace)):
        text = text.replace("{{." + field + "}}", value)
    return isvc, runtime, json.loads(text)


def check_serving(docs, monkeypatch) -> dict:
    """The runtime's container runs `python -m serving` with settings our server accepts, on the
    ports, probes and model the manifests say."""
    from serving import cli as serving_cli
    from serving.http.routes import table

    isvc, runtime, container = served_container(docs)
    where = f"ServingRuntime {runtime['metadata']['name']} + InferenceService {isvc['metadata']['name']}"
    env = container_env(container, docs)
    unknown = [
        n
        for n in env
        if n.startswith(serving_cli.ENV_PREFIX)
        and n[len(serving_cli.ENV_PREFIX) :].lower().replace("_", "-") not in serving_cli.FLAGS
    ]
    if unknown:
        raise ManifestError(
            f"{where}: {unknown} set no flag of the server (python -m serving --help lists them)"
        )
    line = command_line(container, env)
    if line[:3] != ["python", "-m", "serving"]:
        raise ManifestError(f"{where}: the container runs {line[:3]}, not python -m serving")
    parser = argparse.ArgumentParser(prog="python -m serving")
    serving_cli.add_arguments(parser)
    args = parse(parser, line[3:])
    with environment(monkeypatch, env):
        try:
            settings = serving_cli.settings_from_args(args)
        except ValueError as exc:
            raise ManifestError(f"{where}: the server would refuse to start: {exc}") from None
        routes = {route.path for route in table()}
    ports = container["ports"]
    # KServe sends its Service's port 80 to the first port
    if ports[0]["containerPort"] != settings.port:
        raise ManifestError(
            f"{where}: the first port is {ports[0]['containerPort']}, the server's HTTP port "
            f"{settings.port}"
        )
    grpc = [p["containerPort"] for p in ports if "grpc" in p["name"] or "h2c" in p["name"]]
    if grpc != [settings.grpc_port]:
        raise ManifestError(
            f"{where}: gRPC ports {grpc} but the server's --grpc-port is {settings.grpc_port}"
        )
    for probe, path in (
        ("startupProbe", "/v2/health/live"),
        ("livenessProbe", "/v2/health/live"),
        ("readinessProbe", "/v2/health/ready"),
    ):
        get = container[probe]["httpGet"]
        if get["path"] != path or get["path"] not in routes or get["port"] != settings.port:
            raise ManifestError(
                f"{where}: {probe} asks {get['path']} on {get['port']}; the server answers "
                f"{path} on {settings.port}"
            )
    return {"settings": settings, "isvc": isvc, "env": env}


def check_tracking_server(docs, monkeypatch) -> dict:
    """`mlflow server` on PostgreSQL and S3, reached where the ConfigMap's MLFLOW_TRACKING_URI
    says."""
    from mlflow.cli import cli as mlflow_cli

    deployment = named(docs, "Deployment", "trainserve-mlflow")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = container_env(container, docs)
    line = command_line(container, env)
    if line[:2] != ["mlflow", "server"]:
        raise ManifestError(f"Deployment trainserve-mlflow runs {line[:2]}, not mlflow server")
    with environment(monkeypatch, env):
        try:
            params = mlflow_cli.commands["server"].make_context("mlflow server", line[2:]).params
        except Exception as exc:
            # click's UsageError and its kin: the message says which flag
            raise ManifestError(f"mlflow server refuses {line[2:]}: {exc}") from None
    if (
        not params["backend_store_uri"].startswith("postgresql")
        or not (params["artifacts_destination"] or "").startswith("s3://")
        or not params["serve_artifacts"]
    ):
        raise ManifestError(
            f"mlflow server: want PostgreSQL, s3:// artifacts and --serve-artifacts, got {params}"
        )
    service = named(docs, "Service", "trainserve-mlflow")
    port = next(p for p in service["spec"]["ports"])
    target = next(p["containerPort"] for p in container["ports"] if p["name"] == port["targetPort"])
    uri = named(docs, "ConfigMap", "trainserve-tracking")["data"]["MLFLOW_TRACKING_URI"]
    if target != params["port"] or uri != f"http://{service['metadata']['name']}:{port['port']}":
        raise ManifestError(
            f"MLFLOW_TRACKING_URI {uri} should be http://{service['metadata']['name']}:"
            f"{port['port']}, whose target port {target} is mlflow's --port {params['port']}"
        )
    return params


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs():
    return load_documents()


def test_every_manifest_validates_against_its_kinds_schema(docs):
    kinds = {(d["apiVersion"], d["kind"]) for _, d in docs}
    assert {
        ("kubeflow.org/v1", "PyTorchJob"),
        ("serving.kserve.io/v1alpha1", "ServingRuntime"),
        ("serving.kserve.io/v1beta1", "InferenceService"),
        ("v1", "ConfigMap"),
        ("v1", "Secret"),
    } <= kinds
    check_schemas(docs)


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(REPO)))
def test_each_kustomization_applies_every_manifest_beside_it_but_the_ones_applied_by_hand(
    docs, folder
):
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    files = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files - APPLIED_BY_HAND
    images = {c["image"] for f, d in docs if (DEPLOY / f).parent == folder for c in containers(d)}
    assert images <= {i["name"] for i in kustomization["images"]}, (
        "every image is rewritten to the registry"
    )


def test_what_kubectl_apply_k_sends_validates_too():
    """The kustomization rendered by kubectl's own kustomize (namespace, labels, images rewritten in
    the custom resources too) is what reaches the cluster: it validates as the files do."""
    if shutil.which("kubectl") is None:
        pytest.skip(
            "kubectl is not installed: the rendered kustomization is not checked (the files are)"
        )
    docs = []
    for folder in KUSTOMIZATIONS:
        rendered = subprocess.run(
            ["kubectl", "kustomize", str(folder)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        docs += [
            (f"kubectl kustomize {folder.relative_to(REPO)}", d)
            for d in yaml.safe_load_all(rendered)
            if d
        ]
    check_schemas(docs)
    namespace = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["namespace"]
    assert {d["metadata"].get("namespace") for _, d in docs} == {namespace}
    assert all(":" in c["image"] and "/" in c["image"] for _, d in docs for c in containers(d)), (
        "an image kustomize did not rewrite to the registry"
    )


def test_every_config_map_and_secret_reference_resolves(docs):
    checked = 0
    for file, doc in docs:
        for container in containers(doc):
            container_env(
                container,
                docs,
                field_values={
                    "metadata.labels['training.kubeflow.org/job-name']": "a-job",
                    "metadata.labels['batch.kubernetes.io/job-name']": "a-job",
                    "metadata.namespace": "a-namespace",
                },
            )
            checked += len(container.get("env", []))
    assert checked >= 15
    no_secret_values = [
        f"{file}: {e['name']}"
        for file, doc in docs
        for c in containers(doc)
        for e in c.get("env", [])
        if re.search(r"SECRET|PASSWORD|TOKEN|STORE_URI", e["name"]) and "valueFrom" not in e
    ]
    assert not no_secret_values, (
        f"credentials written inline instead of taken from a Secret: {no_secret_values}"
    )


def test_the_training_job_runs_pipeline_train_under_torchrun_as_the_operator_launches_it(
    docs, monkeypatch
):
    found = check_training_job(docs, monkeypatch)
    launch, args, cfg, env = found["launch"], found["args"], found["cfg"], found["env"]
    name = found["job"]["metadata"]["name"]
    assert (launch.rdzv_backend, launch.rdzv_endpoint) == ("c10d", f"{name}-worker-0:29400")
    assert (launch.min_nodes, launch.max_nodes, launch.max_restarts, launch.nproc_per_node) == (
        1,
        2,
        3,
        1,
    )
    assert args.resume == "auto", "a replaced pod must continue the run, not refuse its checkpoints"
    assert launch.run_id == name, (
        "torchrun's run id (TORCHELASTIC_RUN_ID) names this job to the run's owner record"
    )
    assert cfg.train.run_name == name and cfg.train.output_dir == env["CHECKPOINTS_URL"]
    assert cfg.train.output_dir.startswith("s3://"), (
        "the nodes share no disk: checkpoints go to the object store"
    )
    assert {
        "MLFLOW_TRACKING_URI",
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    } <= set(env)


def test_the_indexed_job_runs_the_same_training_without_the_operator(docs, monkeypatch):
    found = check_indexed_training_job(docs, monkeypatch)
    launch, args, cfg, env = found["launch"], found["args"], found["cfg"], found["env"]
    name = found["job"]["metadata"]["name"]
    assert (launch.min_nodes, launch.max_nodes, launch.max_restarts, launch.nproc_per_node) == (
        2,
        2,
        3,
        1,
    )
    assert launch.run_id == name and args.resume == "auto"
    assert cfg.train.run_name == name and cfg.train.output_dir == env["CHECKPOINTS_URL"]


def test_the_inference_service_runs_our_server_following_the_trained_models_champion(
    docs, monkeypatch
):
    found = check_serving(docs, monkeypatch)
    settings, isvc = found["settings"], found["isvc"]
    (source,) = settings.sources()
    assert (settings.host, settings.port, settings.grpc_port) == ("0.0.0.0", 8080, 8081)
    assert (
        settings.model_name == isvc["metadata"]["name"]
        and settings.reload_interval
        and settings.auth_token
    )
    # the CPU request
    assert settings.threads == 2
    # The model it follows is the one the training job's config registers and aliases.
    from pipeline.config import load_config

    job_args = [
        a
        for a in named(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"][
            "spec"
        ]["containers"][0]["args"]
        if a.startswith("--config=")
    ]
    export = load_config(job_args[0].split("=", 1)[1]).export
    assert source.uri == f"models:/{export.registered_model_name}@{export.alias}"
    assert set(found["env"]) == {
        "MLFLOW_TRACKING_URI",
        "TRAINSERVE_AUTH_TOKEN",
        "TRAINSERVE_THREADS",
    }, "the inference server needs no bucket credentials: the tracking server proxies the download"


def test_the_tracking_server_runs_on_postgresql_and_s3(docs, monkeypatch):
    params = check_tracking_server(docs, monkeypatch)
    assert params["port"] == 5000 and params["host"] == "0.0.0.0"


def test_the_publish_job_runs_consolidate_then_export_on_the_run(docs):
    from pipeline import consolidate, export

    job = named(in_file(docs, "publish-job.yaml"), "Job")
    pod = job["spec"]["template"]["spec"]
    (init,), (main,) = pod["initContainers"], pod["containers"]
    for container, module in ((init, consolidate), (main, export)):
        line = command_line(container, container_env(container, docs))
        assert line[:2] == ["pipeline", module.__name__.rsplit(".", 1)[1]]
        args = parse(stage_parser(module), line[2:], intermixed=True)
        assert args.run_id == "REPLACE_WITH_RUN_ID"


# --- break it: the checks above can fail ----------------------------------------------------------


def renamed(doc: dict, path: list, new_key: str) -> dict:
    broken = copy.deepcopy(doc)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[new_key] = node.pop(path[-1])
    return broken


@pytest.mark.parametrize(
    "kind, path, typo",
    [
        ("InferenceService", ["spec", "predictor", "minReplicas"], "minReplica"),
        ("PyTorchJob", ["spec", "elasticPolicy", "rdzvBackend"], "rdzvBackEnd"),
        ("Deployment", ["spec", "template", "spec", "containers", 0, "ports"], "port"),
        ("ConfigMap", ["metadata", "name"], "nmae"),
    ],
)
def test_a_misspelled_field_is_refused(docs, kind, path, typo):
    broken = [(f, renamed(d, path, typo) if d["kind"] == kind else d) for f, d in docs]
    with pytest.raises(ManifestError, match=typo):
        check_schemas(broken)


def with_arg(docs, kind: str, old: str, new: str):
    text = json.dumps([d for _, d in docs])
    assert text.count(json.dumps(old)) >= 1, old
    changed = [
        d
        if d["kind"] != kind
        else json.loads(json.dumps(d).replace(json.dumps(old), json.dumps(new)))
        for _, d in docs
    ]
    return [(f, d) for (f, _), d in zip(docs, changed)]


def test_a_wrong_flag_or_config_key_is_refused(docs, monkeypatch):
    with pytest.raises(ManifestError, match="--reload-intervall"):
        check_serving(
            with_arg(docs, "ServingRuntime", "--reload-interval=30", "--reload-intervall=30"),
            monkeypatch,
        )
    with pytest.raises(ManifestError, match="unrecognized arguments: --resumes=auto"):
        check_training_job(
            with_arg(docs, "PyTorchJob", "--resume=auto", "--resumes=auto"), monkeypatch
        )
    with pytest.raises(ManifestError, match="output_dirs"):
        check_training_job(
            with_arg(
                docs,
                "PyTorchJob",
                "train.output_dir=$(CHECKPOINTS_URL)",
                "train.output_dirs=$(CHECKPOINTS_URL)",
            ),
            monkeypatch,
        )
    # a variable the container does not define
    with pytest.raises(ManifestError, match="CHECKPOINT_URL"):
        check_training_job(
            with_arg(
                docs,
                "PyTorchJob",
                "train.output_dir=$(CHECKPOINTS_URL)",
                "train.output_dir=$(CHECKPOINT_URL)",
            ),
            monkeypatch,
        )
    with pytest.raises(ManifestError, match="--serve-artifact"):
        check_tracking_server(
            with_arg(docs, "Deployment", "--serve-artifacts", "--serve-artifact"), monkeypatch
        )


def test_an_indexed_job_whose_pods_cannot_meet_is_refused(docs, monkeypatch):
    short = "--rdzv-endpoint=$(JOB_NAME)-0.$(JOB_NAME):29400"
    # pod 0 would know it only through DNS
    with pytest.raises(ManifestError, match="pod 0's full name"):
        check_indexed_training_job(
            with_arg(
                docs,
                "Job",
                "--rdzv-endpoint=$(JOB_NAME)-0.$(JOB_NAME).$(NAMESPACE).svc.cluster.local:29400",
                short,
            ),
            monkeypatch,
        )
    with pytest.raises(ManifestError, match="publishNotReadyAddresses"):
        check_indexed_training_job(
            [
                (f, renamed(d, ["spec", "publishNotReadyAddresses"], "publishNotReady"))
                if d["kind"] == "Service" and f.startswith("indexed-job/")
                else (f, d)
                for f, d in docs
            ],
            monkeypatch,
        )
    with pytest.raises(ManifestError, match="torchrun refuses"):
        check_indexed_training_job(
            with_arg(docs, "Job", "--max-restarts=3", "--max-restart-count=3"), monkeypatch
        )
