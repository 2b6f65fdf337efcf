"""`tpuexport deployment`: the Kubernetes YAML for an artifact's target, parsed back and checked
against what the target was compiled for (hosts, chips per host, GKE's TPU node labels) and against
`tpuexport serve` itself (the pods' command parses with serve's own options). One plan-only artifact
(no weights: the YAML depends on its targets alone) planned for one chip, a one-host slice and two
multi-host slices; the CLI runs in this process through click's runner."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import yaml
from click.testing import CliRunner

import tpuexport
from conftest import convert_example
from tpuexport.cli import main, serve

IMAGE = "us-docker.pkg.dev/example/serving/tpuexport:0.1.0"
URI = "gs://example-bucket/models/mlp.tpu"


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory):
    """examples/mlp.py planned (no weights) for v5e, v5e-8 (one host of 8 chips), v5e-16, v5p-16 and one v5p chip."""
    return convert_example("mlp", tmp_path_factory.mktemp("deploy") / "mlp.tpu", target=["v5e", "v5e-8", "v5e-16", "v5p-16", "v5p"],
                           weights=False, saved_model=False)


def deployment(artifact, *options):
    """`tpuexport deployment ARTIFACT --image IMAGE --artifact-uri URI OPTIONS...` in this process (OPTIONS win):
    (exit code, stdout, stderr)."""
    result = CliRunner().invoke(main, ["deployment", str(artifact.path), "--image", IMAGE, "--artifact-uri", URI, *map(str, options)])
    return result.exit_code, result.stdout, result.stderr


def written(artifact, out: pathlib.Path, *options) -> list[dict]:
    """The Kubernetes objects `tpuexport deployment ... -o OUT` writes, parsed."""
    code, _, stderr = deployment(artifact, *options, "-o", out)
    assert code == 0, stderr
    return list(yaml.safe_load_all(out.read_text()))


def parsed_by_serve(command: list[str], **environment: str) -> dict:
    """The options `tpuexport serve` takes from a pod's command, with Kubernetes' $(VAR) expanded."""
    assert command[:2] == ["tpuexport", "serve"]
    arguments = list(command[2:])
    for name, value in environment.items():
        arguments = [argument.replace(f"$({name})", value) for argument in arguments]
    with serve.make_context("serve", arguments) as context:
        return context.params


@pytest.mark.parametrize("target, hosts, chips, accelerator, topology", [
    ("v5e-16", 4, 4, "tpu-v5-lite-podslice", "4x4"),  # Cloud TPU's v5litepod-16: 4 VMs of 4 chips
    ("v5p-16", 2, 4, "tpu-v5p-slice", "2x2x2"),  # 16 TensorCores, 8 chips: 2 VMs of 4 chips
])
def test_a_multi_host_slice_is_a_leader_worker_set_of_one_pod_per_host(mlp_plan, tmp_path, target, hosts, chips, accelerator, topology):
    assert mlp_plan.manifest["targets"][target]["processes"] == hosts
    workload, service = written(mlp_plan, tmp_path / "mlp.yaml", "--target", target, "--name", "mlp")
    assert (workload["apiVersion"], workload["kind"], service["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "Service")
    group = workload["spec"]["leaderWorkerTemplate"]
    assert group["size"] == hosts and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"]["spec"], group["workerTemplate"]["spec"]
    for pod in (leader, worker):
        [container] = pod["containers"]
        assert container["resources"] == {"requests": {"google.com/tpu": chips}, "limits": {"google.com/tpu": chips}}
        assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": accelerator, "cloud.google.com/gke-tpu-topology": topology}
        assert container["command"] == leader["containers"][0]["command"]  # every host runs the same command
    # The follower with index 1, as LWS's environment gives it: serve parses its command with the slice's cluster flags.
    options = parsed_by_serve(worker["containers"][0]["command"], LWS_LEADER_ADDRESS="mlp-0.mlp.default", LWS_WORKER_INDEX="1")
    assert options["artifacts"] == (pathlib.Path("/artifacts/mlp.tpu"),) and options["target"] == target
    assert (options["coordinator"], options["num_processes"], options["process_id"]) == ("mlp-0.mlp.default:8476", hosts, 1)
    assert options["host"] == "0.0.0.0" and (options["port"], options["grpc_port"]) == (8501, 8500)
    # Only the leader serves: ports and probes on it, and the Service selects it alone (LWS's worker index 0). The
    # Service is not named as the set: LWS would take it for the headless Service that gives the pods their DNS names.
    assert (workload["metadata"]["name"], service["metadata"]["name"]) == ("mlp", "mlp-leader")
    assert {port["name"]: port["containerPort"] for port in leader["containers"][0]["ports"]} == {"rest": 8501, "grpc": 8500}
    assert leader["containers"][0]["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "rest"}
    assert "ports" not in worker["containers"][0] and "readinessProbe" not in worker["containers"][0]
    assert service["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": "mlp", "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert [(port["port"], port["targetPort"]) for port in service["spec"]["ports"]] == [(8501, "rest"), (8500, "grpc")]


@pytest.mark.parametrize("target, chips, topology", [("v5e", 1, "1x1"), ("v5e-8", 8, "2x4")])
def test_one_host_is_a_deployment_and_a_service_reading_the_artifact_from_its_bucket(mlp_plan, tmp_path, target, chips, topology):
    workload, service = written(mlp_plan, tmp_path / "mlp.yaml", "--target", target, "--replicas", 2)
    assert (workload["kind"], service["kind"], workload["spec"]["replicas"]) == ("Deployment", "Service", 2)
    pod = workload["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert container["resources"]["limits"] == {"google.com/tpu": chips}
    assert pod["spec"]["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                           "cloud.google.com/gke-tpu-topology": topology}
    options = parsed_by_serve(container["command"])
    assert options["target"] == target and options["coordinator"] is None and options["num_processes"] is None
    # The bucket's directory mounted read-only where the command reads it, under the artifact's own name (the model's name).
    [volume] = pod["spec"]["volumes"]
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert volume["csi"]["volumeAttributes"] == {"bucketName": "example-bucket", "mountOptions": "implicit-dirs,only-dir=models/mlp.tpu"}
    assert container["volumeMounts"] == [{"name": volume["name"], "mountPath": "/artifacts/mlp.tpu", "readOnly": True}]
    assert options["artifacts"] == (pathlib.Path("/artifacts/mlp.tpu"),)
    assert pod["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    assert service["spec"]["selector"] == workload["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "mlp"}


@pytest.mark.parametrize("options, expected", [
    (("--target", "v6e-8"), "error: the artifact has no target 'v6e-8'; it has v5e, v5e-8, v5e-16, v5p-16, v5p: deploy one of those, "
                            "or convert with --target v6e-8"),
    (("--target", "v5e-16", "--kind", "helm"), "error: unknown --kind 'helm'; tpuexport writes kubernetes"),
    (("--target", "v5p"), "error: GKE has no one-chip TPU v5p node (the smallest is 2x2x1, 4 chips); convert for --target v5p-8"),
    (("--target", "v5e", "--artifact-uri", "models/mlp.tpu"), "error: --artifact-uri 'models/mlp.tpu': give gs://BUCKET/PATH"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(mlp_plan, tmp_path, options, expected):
    out = tmp_path / "mlp.yaml"
    code, stdout, stderr = deployment(mlp_plan, *options, "-o", out)
    assert code == 2 and stdout == "" and not out.exists()
    [line] = stderr.strip().splitlines()
    assert line.startswith(expected), line


def test_a_slice_converted_before_hosts_were_recorded_is_refused(mlp_plan, tmp_path):
    """An artifact from before the manifest recorded a slice's hosts (its `processes`): no host count to
    deploy with, so not a guess of one host of 16 chips."""
    older = pathlib.Path(shutil.copytree(mlp_plan.path, tmp_path / "mlp.tpu"))
    manifest = json.loads((older / "manifest.json").read_text())
    del manifest["targets"]["v5e-16"]["processes"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    code, stdout, stderr = deployment(tpuexport.load(older), "--target", "v5e-16")
    assert (code, stdout, stderr.strip()) == (2, "", "error: the artifact's target v5e-16 records no host count (converted before "
                                                      "tpuexport recorded one); convert it again")
