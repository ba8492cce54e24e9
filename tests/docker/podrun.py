"""Run a pod spec's containers on Docker as the kubelet would lay them out, for the docker tier.

A pod is one network namespace shared by its containers and, here, nothing else: each container
gets its own PID, IPC and mount namespaces (no shareProcessNamespace). So a `pause` container holds
the pod's network namespace (`--network none`: its own loopback), and every container of the spec
joins it (`--network container:<pause>`): the spec's own ports, no collision with the host's.
From the spec, each container takes its command and args, env, user and group (the pod's
securityContext), read-only root filesystem, dropped capabilities, no privilege escalation and
memory limit. Volumes: an emptyDir is a host directory made as the kubelet makes one for a pod with
an fsGroup (root, group fsGroup, mode 2777); the checkpoint's claim is the test's model directory,
read-only. What Docker cannot take from the spec: the GPU claim (CI has no GPU) and the probes,
which the test applies itself. A Secret the spec names (env valueFrom secretKeyRef) comes from
`secrets`, keyed (secret name, key), as `kubectl create secret` would have made it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dockerlib import docker

PAUSE = ["sleep", "infinity"]


def _memory(quantity: str) -> str:
    """A Kubernetes memory quantity (4Gi, 256Mi) as Docker's --memory (4g, 256m)."""
    m = re.fullmatch(r"(\d+)([KMG])i", quantity)
    assert m, f"unsupported memory quantity {quantity!r}"
    return f"{m.group(1)}{m.group(2).lower()}"


@dataclass
class PodRun:
    pod: dict
    image: str
    model: Path
    name: str
    containers: list[str] = field(default_factory=list)
    dirs: dict[str, Path] = field(default_factory=dict)
    secrets: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def spec(self) -> dict:
        return self.pod["spec"]

    @property
    def pause(self) -> str:
        return f"{self.name}-pause"

    def start_pause(self) -> None:
        sc = self.spec["securityContext"]
        docker("run", "-d", "--name", self.pause, "--network", "none", "--user", f"{sc['runAsUser']}:{sc['runAsGroup']}",
               "--entrypoint", PAUSE[0], self.image, *PAUSE[1:])
        self.containers.append(self.pause)

    def volume(self, v: dict) -> tuple[str, bool]:
        """The host path behind a pod volume, and whether it is read-only."""
        if "persistentVolumeClaim" in v:
            return str(self.model), True
        assert set(v) == {"name", "emptyDir"}, f"unsupported volume {v}"
        if v["name"] not in self.dirs:
            d = Path(tempfile.mkdtemp(prefix=f"{self.name}-{v['name']}-", dir="/tmp"))
            os.chown(d, 0, self.spec["securityContext"]["fsGroup"])
            d.chmod(0o2777)  # the kubelet's emptyDir for a pod with an fsGroup
            self.dirs[v["name"]] = d
        return str(self.dirs[v["name"]]), False

    def argv(self, c: dict, detach: bool, restart: bool = False) -> list[str]:
        sc, csc = self.spec["securityContext"], c.get("securityContext", {})
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        out = ["run", "--name", f"{self.name}-{c['name']}", "--network", f"container:{self.pause}",
               "--user", f"{sc['runAsUser']}:{sc['runAsGroup']}", "--group-add", str(sc["fsGroup"])]
        if detach:
            out.insert(1, "-d")
        if restart:
            out += ["--restart", "always"]  # the kubelet's part: the pod's restartPolicy Always
        if csc.get("readOnlyRootFilesystem"):
            out.append("--read-only")
        if csc.get("capabilities", {}).get("drop") == ["ALL"]:
            out += ["--cap-drop", "ALL"]
        if csc.get("allowPrivilegeEscalation") is False:
            out += ["--security-opt", "no-new-privileges"]
        limits = c.get("resources", {}).get("limits", {})
        if "memory" in limits:
            out += ["--memory", _memory(limits["memory"])]
        for e in c.get("env", []):
            out += ["-e", f"{e['name']}={self.env_value(e)}"]
        for m in c.get("volumeMounts", []):
            host, ro = self.volume(volumes[m["name"]])
            out += ["-v", f"{host}:{m['mountPath']}{':ro' if ro or m.get('readOnly') else ''}"]
        command = c.get("command")
        if command:
            out += ["--entrypoint", command[0], self.image, *command[1:]]
        else:
            out.append(self.image)
        return out + list(c.get("args", []))

    def env_value(self, e: dict) -> str:
        """An env entry's value: written in the spec, or taken from a Secret the test created."""
        if "value" in e:
            return e["value"]
        ref = e["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) in self.secrets, f"the spec needs secret {ref}; the test gave none"
        return self.secrets[ref["name"], ref["key"]]

    def run(self, c: dict, detach: bool = True, restart: bool = False, timeout: float = 120):
        self.containers.append(f"{self.name}-{c['name']}")
        return docker(*self.argv(c, detach, restart), check=False, timeout=timeout)

    def exec_python(self, container: str, code: str, *args: str):
        return docker("exec", f"{self.name}-{container}", "python3", "-c", code, *args, check=False)

    def remove(self) -> None:
        if self.containers:
            docker("rm", "-f", *reversed(self.containers), check=False, timeout=60)
        for d in self.dirs.values():
            shutil.rmtree(d, ignore_errors=True)
