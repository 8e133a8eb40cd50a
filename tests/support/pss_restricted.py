"""Pod Security Standards "restricted" profile (which includes "baseline"), rule by rule.

Written out from https://kubernetes.io/docs/concepts/security/pod-security-standards/ so a
test can name the rule a manifest breaks. Input: a pod manifest as the API sees it
(camelCase keys, e.g. ``ApiClient().sanitize_for_serialization(pod)``). Plus one rule of
ours beyond the profile: every container has a read-only root filesystem.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

ALLOWED_VOLUME_SOURCES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(spec: dict) -> Iterator[dict]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(kind) or []


def _csc(c: dict) -> dict:
    return c.get("securityContext") or {}


def _psc(spec: dict) -> dict:
    return spec.get("securityContext") or {}


def _effective(spec: dict, c: dict, key: str):
    """A container-level setting, falling back to the pod level (as the kubelet does)."""
    v = _csc(c).get(key)
    return _psc(spec).get(key) if v is None else v


# ---- baseline ----------------------------------------------------------------------------


def host_process(spec):
    sc = [_psc(spec)] + [_csc(c) for c in _containers(spec)]
    return [s for s in sc if (s.get("windowsOptions") or {}).get("hostProcess")]


def host_namespaces(spec):
    return [k for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]


def privileged(spec):
    return [c["name"] for c in _containers(spec) if _csc(c).get("privileged")]


def capabilities_baseline(spec):
    return [
        (c["name"], a)
        for c in _containers(spec)
        for a in ((_csc(c).get("capabilities") or {}).get("add") or [])
        if a not in BASELINE_CAPABILITIES
    ]


def host_path_volumes(spec):
    return [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]


def host_ports(spec):
    return [
        (c["name"], p.get("hostPort"))
        for c in _containers(spec)
        for p in c.get("ports") or []
        if p.get("hostPort") not in (None, 0)
    ]


def apparmor(spec):
    profiles = [_psc(spec).get("appArmorProfile")] + [_csc(c).get("appArmorProfile") for c in _containers(spec)]
    return [p for p in profiles if p and p.get("type") not in ("RuntimeDefault", "Localhost")]


def selinux(spec):
    opts = [_psc(spec).get("seLinuxOptions")] + [_csc(c).get("seLinuxOptions") for c in _containers(spec)]
    return [o for o in opts if o and (o.get("type") not in SELINUX_TYPES or o.get("user") or o.get("role"))]


def proc_mount(spec):
    return [c["name"] for c in _containers(spec) if _csc(c).get("procMount") not in (None, "Default")]


def seccomp_not_unconfined(spec):
    profiles = [_psc(spec).get("seccompProfile")] + [_csc(c).get("seccompProfile") for c in _containers(spec)]
    return [p for p in profiles if p and p.get("type") == "Unconfined"]


def sysctls(spec):
    return [s["name"] for s in _psc(spec).get("sysctls") or [] if s["name"] not in SAFE_SYSCTLS]


# ---- restricted --------------------------------------------------------------------------


def volume_types(spec):
    out = []
    for v in spec.get("volumes") or []:
        sources = set(v) - {"name"}
        if not sources <= ALLOWED_VOLUME_SOURCES:
            out.append((v["name"], sorted(sources - ALLOWED_VOLUME_SOURCES)))
    return out


def privilege_escalation(spec):
    return [c["name"] for c in _containers(spec) if _csc(c).get("allowPrivilegeEscalation") is not False]


def run_as_non_root(spec):
    return [c["name"] for c in _containers(spec) if _effective(spec, c, "runAsNonRoot") is not True]


def run_as_user_not_root(spec):
    bad = [c["name"] for c in _containers(spec) if _csc(c).get("runAsUser") == 0]
    return bad + (["<pod>"] if _psc(spec).get("runAsUser") == 0 else [])


def seccomp_set(spec):
    ok = ("RuntimeDefault", "Localhost")
    return [
        c["name"]
        for c in _containers(spec)
        if (_csc(c).get("seccompProfile") or _psc(spec).get("seccompProfile") or {}).get("type") not in ok
    ]


def capabilities_restricted(spec):
    out = []
    for c in _containers(spec):
        caps = _csc(c).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append((c["name"], "does not drop ALL"))
        extra = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            out.append((c["name"], f"adds {sorted(extra)}"))
    return out


# ---- ours --------------------------------------------------------------------------------


def read_only_root_filesystem(spec):
    return [c["name"] for c in _containers(spec) if _csc(c).get("readOnlyRootFilesystem") is not True]


RULES: dict[str, Callable[[dict], list]] = {
    "baseline/host-process": host_process,
    "baseline/host-namespaces": host_namespaces,
    "baseline/privileged-containers": privileged,
    "baseline/capabilities": capabilities_baseline,
    "baseline/hostpath-volumes": host_path_volumes,
    "baseline/host-ports": host_ports,
    "baseline/apparmor": apparmor,
    "baseline/selinux": selinux,
    "baseline/proc-mount": proc_mount,
    "baseline/seccomp": seccomp_not_unconfined,
    "baseline/sysctls": sysctls,
    "restricted/volume-types": volume_types,
    "restricted/privilege-escalation": privilege_escalation,
    "restricted/run-as-non-root": run_as_non_root,
    "restricted/run-as-non-root-user": run_as_user_not_root,
    "restricted/seccomp": seccomp_set,
    "restricted/capabilities": capabilities_restricted,
    "extra/read-only-root-filesystem": read_only_root_filesystem,
}


def violations(manifest: dict) -> dict[str, list]:
    """Rule name -> what breaks it, for every rule the pod manifest breaks (empty: compliant)."""
    spec = manifest["spec"]
    return {name: found for name, rule in RULES.items() if (found := rule(spec))}
