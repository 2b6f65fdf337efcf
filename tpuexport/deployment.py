"""Kubernetes manifests that serve an artifact's target on GKE (`tpuexport deployment`, docs/deployment.md).

One host (a single chip, v5e-8, v6e-8, v5p-8, cpu, cpu-N): a Deployment and a Service. A multi-host
slice (v5e-16, v5p-16, ..., cpu-PxK): a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) with one pod per
host, `size` the hosts the target was compiled for, and a Service for its leader (process 0, which
serves REST and gRPC). Every pod runs `tpuexport serve` with the target; on a multi-host slice with
`--coordinator $(LWS_LEADER_ADDRESS):PORT --num-processes HOSTS --process-id $(LWS_WORKER_INDEX)`.

Hosts and chips per host come from the artifact's manifest (the target's `processes` and `chips`: what
its executables were compiled for, compile/slices.py), not from the cluster.
"""

from __future__ import annotations

import dataclasses
import re

import yaml

from tpuexport.compile import resolve_targets
from tpuexport.errors import TpuExportError

KINDS = ("kubernetes",)
# GKE's node labels for a TPU slice's chip and topology, with the values GKE documents per TPU version
# (https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus, "Choose the TPU topology"; the
# pods select them as in https://cloud.google.com/kubernetes-engine/docs/how-to/tpus). Keyed by the
# libtpu topology's generation (targets.py): the topology after the colon is GKE's topology value.
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
GKE_ACCELERATORS = {"v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice", "v5p": "tpu-v5p-slice", "tpu7x": "tpu7x"}
# Generations whose smallest GKE node holds 4 chips (2x2x1): a one-chip target has no node of its own;
# the slice to convert for instead (none for v4, whose slices tpuexport does not compile, slices.py).
NO_ONE_CHIP_NODE = {"v4": None, "v5p": "v5p-8", "tpu7x": "7x-8"}
TPU_RESOURCE = "google.com/tpu"
# LWS's labels and the environment it gives every pod of a group (kubernetes-sigs/lws,
# api/leaderworkerset/v1/leaderworkerset_types.go).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/exclusive-topology"
# Where a gs:// artifact is mounted in the pods (its directory name kept: serve names the model after it).
MOUNT_ROOT = "/artifacts"
NAME_PATTERN = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# LWS names pods NAME-GROUP-WORKER and its StatefulSets' pods get a revision hash: room under 63 characters.
MAX_NAME_LENGTH = 40


@dataclasses.dataclass(frozen=True)
class Hosts:
    """The machines a target runs on, read from its manifest record.

    Attributes:
      target: the target's name in the artifact ("v5e-16").
      hosts: processes, one per host (the pods of a group).
      chips_per_host: TPU chips each host's process drives (google.com/tpu per pod); 0 for a CPU target.
      accelerator: GKE's cloud.google.com/gke-tpu-accelerator value; None for a CPU target.
      topology: GKE's cloud.google.com/gke-tpu-topology value ("4x4"); None for a CPU target.
      cpu_devices: forced XLA:CPU devices per process of a CPU twin (cpu-N, cpu-PxK); 0 otherwise.
      versions: the jax, jaxlib and libtpu versions the executables were compiled with (the image's).
    """

    target: str
    hosts: int
    chips_per_host: int
    accelerator: str | None
    topology: str | None
    cpu_devices: int
    versions: dict


@dataclasses.dataclass(frozen=True)
class PodOptions:
    """How the pods find the artifact and serve it.

    Attributes:
      name: the Kubernetes objects' name (a DNS label of at most MAX_NAME_LENGTH characters).
      image: a container image with tpuexport[serve] and the artifact's jax, jaxlib and libtpu.
      artifact_uri: gs://BUCKET/PATH (mounted read-only by GKE's Cloud Storage FUSE CSI driver) or an
        absolute path inside the pod (in the image, or on a volume added to the manifest).
      replicas: Deployment replicas, or LeaderWorkerSet groups (one slice each).
      port: serve's REST port (TF Serving's REST API, /readyz).
      grpc_port: serve's gRPC port; 0 for none.
      coordinator_port: the leader's jax.distributed coordinator port (multi-host slices).
      process_timeout: serve's --process-timeout (multi-host slices).
      service_account: the pods' Kubernetes service account (one allowed to read the bucket); None for the default.
    """

    name: str
    image: str
    artifact_uri: str
    replicas: int = 1
    port: int = 8501
    grpc_port: int = 8500
    coordinator_port: int = 8476
    process_timeout: float = 60.0
    service_account: str | None = None


def target_hosts(manifest: dict, requested: str) -> Hosts:
    """The hosts of the artifact's target `requested` (any spelling resolve_targets accepts).

    Raises:
      TpuExportError: an unknown target, one the artifact was not compiled for (naming those it
        has), a slice converted before hosts were recorded, or a single chip GKE has no node for.
    """
    name = resolve_targets([requested])[0].name
    targets = manifest["targets"]
    if name not in targets:
        raise TpuExportError(f"the artifact has no target {requested!r}; it has {', '.join(targets) or 'none'}: deploy one of "
                             f"those, or convert with --target {requested}")
    record = targets[name]
    chips = record.get("chips", 1)
    if chips > 1 and "processes" not in record:
        raise TpuExportError(f"the artifact's target {name} records no host count (converted before tpuexport recorded one); "
                             "convert it again")
    hosts = record.get("processes", 1)
    versions = (record.get("compile_key") or {}).get("versions", {})
    if record["platform"] == "cpu":
        return Hosts(name, hosts, 0, None, None, chips // hosts if chips > 1 else 0, versions)
    generation, grid = record["topology"].split(":")
    if chips == 1 and generation in NO_ONE_CHIP_NODE:
        instead = NO_ONE_CHIP_NODE[generation]
        raise TpuExportError(f"GKE has no one-chip {record['generation']} node (the smallest is 2x2x1, 4 chips); "
                             + (f"convert for --target {instead} and deploy that" if instead else "deploy a v5e or v6e chip instead"))
    return Hosts(name, hosts, chips // hosts, GKE_ACCELERATORS[generation], grid, 0, versions)


def default_name(artifact_name: str) -> str:
    """A Kubernetes name from an artifact directory's name ("Llama_3.tpu" -> "llama-3"), or "" if none is left."""
    name = re.sub(r"[^a-z0-9]+", "-", artifact_name.split(".")[0].lower()).strip("-")
    name = name.lstrip("0123456789-")
    return name[:MAX_NAME_LENGTH].rstrip("-")


def check_options(options: PodOptions) -> None:
    """Raises TpuExportError (one line naming the fix) for a name Kubernetes refuses, an artifact URI
    the pods cannot open, or ports and counts out of range."""
    if not NAME_PATTERN.fullmatch(options.name) or len(options.name) > MAX_NAME_LENGTH:
        raise TpuExportError(f"--name {options.name!r} is not a Kubernetes name: lowercase letters, digits and '-', starting with "
                             f"a letter, at most {MAX_NAME_LENGTH} characters (e.g. --name llama-v5e16)")
    uri = options.artifact_uri
    if not (uri.startswith("/") or re.fullmatch(r"gs://[a-z0-9][-_.a-z0-9]*[a-z0-9]/\S+", uri)):
        raise TpuExportError(f"--artifact-uri {uri!r}: give gs://BUCKET/PATH/TO/ARTIFACT.tpu (mounted with GKE's Cloud Storage "
                             "FUSE CSI driver) or an absolute path in the pod (e.g. /models/m.tpu in the image)")
    ports = {"--port": options.port, "--coordinator-port": options.coordinator_port,
             **({"--grpc-port": options.grpc_port} if options.grpc_port else {})}
    for flag, port in ports.items():
        if not 1 <= port <= 65535:
            raise TpuExportError(f"{flag} {port} is not a port (1 to 65535)")
    if len(set(ports.values())) != len(ports):
        raise TpuExportError(f"{', '.join(f'{flag} {port}' for flag, port in ports.items())}: give each a port of its own")
    if options.replicas < 1:
        raise TpuExportError(f"--replicas {options.replicas}: give 1 or more")


def artifact_path(options: PodOptions) -> str:
    """The artifact's path inside the pods."""
    uri = options.artifact_uri.rstrip("/")
    return f"{MOUNT_ROOT}/{uri.rsplit('/', 1)[1]}" if uri.startswith("gs://") else uri


def serve_command(hosts: Hosts, options: PodOptions) -> list[str]:
    """What every pod runs: `tpuexport serve` on all interfaces, and on several hosts, joined to the leader
    through the environment LWS gives each pod (the same command in every pod, Kubernetes expands $(VAR))."""
    command = ["tpuexport", "serve", artifact_path(options), "--target", hosts.target, "--host", "0.0.0.0",
               "--port", str(options.port), "--grpc-port", str(options.grpc_port)]
    if hosts.hosts > 1:
        command += ["--coordinator", f"$(LWS_LEADER_ADDRESS):{options.coordinator_port}", "--num-processes", str(hosts.hosts),
                    "--process-id", "$(LWS_WORKER_INDEX)", "--process-timeout", f"{options.process_timeout:g}"]
    return command


def kubernetes_objects(hosts: Hosts, options: PodOptions) -> list[dict]:
    """The Kubernetes objects serving the target: [Deployment, Service] on one host, [LeaderWorkerSet,
    Service] on several (see the module docstring)."""
    check_options(options)
    labels = {"app.kubernetes.io/name": options.name, "app.kubernetes.io/managed-by": "tpuexport"}
    if hosts.hosts == 1:
        workload = {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": options.name, "labels": labels},
            "spec": {"replicas": options.replicas, "selector": {"matchLabels": {"app.kubernetes.io/name": options.name}},
                     "template": _pod_template(hosts, options, labels, serving=True)},
        }
        selector = {"app.kubernetes.io/name": options.name}
        service_name = options.name
    else:
        workload = {
            "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            # One group per slice: its pods on one node pool (a GKE TPU slice is one node pool).
            "metadata": {"name": options.name, "labels": labels,
                         **({"annotations": {LWS_EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"}} if hosts.accelerator else {})},
            "spec": {
                "replicas": options.replicas,
                # Followers are created with the leader: it is ready only once they have joined it.
                "startupPolicy": "LeaderCreated",
                "leaderWorkerTemplate": {
                    "size": hosts.hosts,
                    # The processes run as one program: a restarted pod restarts the group (docs/deployment.md).
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": _pod_template(hosts, options, labels, serving=True),
                    "workerTemplate": _pod_template(hosts, options, labels, serving=False),
                },
            },
        }
        selector = {LWS_NAME_LABEL: options.name, LWS_WORKER_INDEX_LABEL: "0"}
        # Not the set's own name: LWS names its headless Service (the pods' DNS records, LWS_LEADER_ADDRESS)
        # after the set, and uses an existing Service of that name instead (kubernetes-sigs/lws,
        # pkg/utils/controller/controller_utils.go), which would leave the followers unable to find the leader.
        service_name = f"{options.name}-leader"
    ports = [{"name": "rest", "port": options.port, "targetPort": "rest"}]
    if options.grpc_port:
        ports.append({"name": "grpc", "port": options.grpc_port, "targetPort": "grpc"})
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": service_name, "labels": labels},
               "spec": {"selector": selector, "ports": ports}}
    return [workload, service]


def _pod_template(hosts: Hosts, options: PodOptions, labels: dict, serving: bool) -> dict:
    """A pod of the target: the serving one (a single host's, or a slice's leader) with its ports and
    probes, or a follower of a slice (no server: it runs the leader's steps)."""
    container = {"name": "serve", "image": options.image, "command": serve_command(hosts, options)}
    if hosts.cpu_devices:
        container["env"] = [{"name": "XLA_FLAGS", "value": f"--xla_force_host_platform_device_count={hosts.cpu_devices}"}]
    if hosts.chips_per_host:
        chips = {TPU_RESOURCE: hosts.chips_per_host}
        container["resources"] = {"requests": dict(chips), "limits": dict(chips)}
    if serving:
        container["ports"] = [{"name": "rest", "containerPort": options.port}]
        if options.grpc_port:
            container["ports"].append({"name": "grpc", "containerPort": options.grpc_port})
        container.update(_probes(options.port, multi_host=hosts.hosts > 1))
    if options.artifact_uri.startswith("gs://"):
        container["volumeMounts"] = [{"name": "artifact", "mountPath": artifact_path(options), "readOnly": True}]
    spec: dict = {"containers": [container]}
    if options.service_account:
        spec["serviceAccountName"] = options.service_account
    if hosts.accelerator:
        spec["nodeSelector"] = {ACCELERATOR_LABEL: hosts.accelerator, TOPOLOGY_LABEL: hosts.topology}
        spec["tolerations"] = [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    metadata: dict = {"labels": dict(labels)}
    if options.artifact_uri.startswith("gs://"):
        bucket, _, directory = options.artifact_uri.removeprefix("gs://").rstrip("/").partition("/")
        # GKE injects the Cloud Storage FUSE sidecar into pods with this annotation.
        metadata["annotations"] = {"gke-gcsfuse/volumes": "true"}
        spec["volumes"] = [{"name": "artifact", "csi": {
            "driver": "gcsfuse.csi.storage.gke.io", "readOnly": True,
            # implicit-dirs: a directory uploaded with `gcloud storage cp -r` has no directory objects.
            "volumeAttributes": {"bucketName": bucket, "mountOptions": f"implicit-dirs,only-dir={directory}"}}}]
    return {"metadata": metadata, "spec": spec}


def _probes(port: int, multi_host: bool) -> dict:
    """The serving container's probes: started once /healthz answers (loading a large model takes minutes),
    ready while /readyz is 200. Alive while /healthz answers; a slice's leader while /readyz is 200, since
    /readyz turns 503 for good once a follower is lost, and restarting the leader restarts the group."""
    startup = {"httpGet": {"path": "/healthz", "port": "rest"}, "periodSeconds": 10, "failureThreshold": 90}
    return {
        "startupProbe": startup,
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "rest"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/readyz" if multi_host else "/healthz", "port": "rest"},
                          "periodSeconds": 10, "failureThreshold": 3},
    }


def render(kind: str, hosts: Hosts, options: PodOptions, artifact: str) -> str:
    """The manifests of `kind` as YAML documents, after a comment saying what they need.

    Raises:
      TpuExportError: an unknown kind, or options check_options refuses.
    """
    if kind not in KINDS:
        raise TpuExportError(f"unknown --kind {kind!r}; tpuexport writes {', '.join(KINDS)} (a Deployment and a Service for one "
                             "host, a LeaderWorkerSet and a Service for a multi-host slice)")
    objects = kubernetes_objects(hosts, options)
    chips = f"{hosts.chips_per_host} chip{'s' if hosts.chips_per_host > 1 else ''}"
    where = (f"{chips} of a {hosts.accelerator} {hosts.topology} slice" if hosts.accelerator
             else f"{hosts.cpu_devices or 1} CPU device{'s' if hosts.cpu_devices > 1 else ''}")
    lines = [f"tpuexport deployment of {artifact}, target {hosts.target}: "
             + (f"a LeaderWorkerSet of {hosts.hosts} pods (one per host, {where} each) and a Service {options.name}-leader for its leader."
                if hosts.hosts > 1 else f"a Deployment ({where} per pod) and a Service.")]
    if hosts.hosts > 1:
        lines.append("Needs the LeaderWorkerSet controller in the cluster (https://lws.sigs.k8s.io).")
    versions = ", ".join(f"{package} {version}" for package, version in hosts.versions.items())
    lines.append(f"The image needs tpuexport[serve]{' with ' + versions + ' (those the executables were compiled with)' if versions else ''}.")
    lines.append("docs/deployment.md says what each pod runs and what happens when one fails.")
    header = "".join(f"# {line}\n" for line in lines)
    return header + yaml.safe_dump_all(objects, sort_keys=False)
