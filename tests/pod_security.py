"""The Pod Security Standards' "restricted" profile as a checker of a pod spec: every control of the
baseline profile and the ones restricted adds, as listed in
https://kubernetes.io/docs/concepts/security/pod-security-standards/ (Linux pods; policy version latest).
`restricted_violations` returns one line per violation, naming the field; an empty list is a pass."""

# The only capability a container may add (baseline allows a longer list; restricted this one).
RESTRICTED_ADDABLE_CAPABILITIES = {"NET_BIND_SERVICE"}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
PROFILE_TYPES = {"RuntimeDefault", "Localhost"}  # seccomp (restricted: required) and AppArmor (baseline: if set)
# Restricted: the only volume types allowed.
VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def containers(spec: dict):
    """(where, container) for every container of the pod, init and ephemeral ones included."""
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(kind) or []:
            yield f"{kind}[{c.get('name')}]", c


def restricted_violations(spec: dict, annotations: dict | None = None) -> list[str]:
    pod = spec.get("securityContext") or {}
    found = []
    # Baseline: host namespaces, HostProcess, sysctls, host paths, AppArmor annotations.
    found += [f"spec.{key}: must be unset or false" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    found += [f"spec.securityContext.sysctls: {s.get('name')} is not a safe sysctl"
              for s in pod.get("sysctls") or [] if s.get("name") not in SAFE_SYSCTLS]
    for key, value in (annotations or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and not (value == "runtime/default" or value.startswith("localhost/")):
            found.append(f"annotation {key}: {value!r} is not runtime/default or localhost/*")
    # Restricted: volume types (baseline's hostPath ban included).
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= VOLUME_TYPES:
            found.append(f"spec.volumes[{volume.get('name')}]: type {sorted(kinds - VOLUME_TYPES)} is not allowed")
    found += _security_context_violations("spec.securityContext", pod)
    pod_non_root = pod.get("runAsNonRoot") is True
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type") in PROFILE_TYPES
    for where, c in containers(spec):
        sc = c.get("securityContext") or {}
        field = f"spec.{where}.securityContext"
        found += _security_context_violations(field, sc)
        if sc.get("privileged"):
            found.append(f"{field}.privileged: must be unset or false")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"{field}.procMount: must be unset or Default")
        found += [f"spec.{where}.ports[{p.get('name')}].hostPort: must be unset or 0" for p in c.get("ports") or []
                  if p.get("hostPort")]
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{field}.allowPrivilegeEscalation: must be false")
        if sc.get("runAsNonRoot") is False or not (pod_non_root or sc.get("runAsNonRoot") is True):
            found.append(f"{field}.runAsNonRoot: must be true here or in spec.securityContext (and not false here)")
        if not (pod_seccomp or (sc.get("seccompProfile") or {}).get("type") in PROFILE_TYPES):
            found.append(f"{field}.seccompProfile.type: must be RuntimeDefault or Localhost here or in spec.securityContext")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{field}.capabilities.drop: must include ALL")
        added = set(capabilities.get("add") or []) - RESTRICTED_ADDABLE_CAPABILITIES
        if added:
            found.append(f"{field}.capabilities.add: {sorted(added)} not allowed (only NET_BIND_SERVICE)")
    return found


def _security_context_violations(field: str, sc: dict) -> list[str]:
    """The controls a pod's and a container's securityContext share."""
    found = []
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        found.append(f"{field}.windowsOptions.hostProcess: must be unset or false")
    seccomp = (sc.get("seccompProfile") or {}).get("type")
    if seccomp is not None and seccomp not in PROFILE_TYPES:
        found.append(f"{field}.seccompProfile.type: {seccomp!r} must be RuntimeDefault or Localhost")
    apparmor = (sc.get("appArmorProfile") or {}).get("type")
    if apparmor is not None and apparmor not in PROFILE_TYPES:
        found.append(f"{field}.appArmorProfile.type: {apparmor!r} must be RuntimeDefault or Localhost")
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES:
        found.append(f"{field}.seLinuxOptions.type: {selinux['type']!r} is not allowed")
    found += [f"{field}.seLinuxOptions.{key}: must be unset" for key in ("user", "role") if selinux.get(key)]
    if sc.get("runAsUser") == 0:
        found.append(f"{field}.runAsUser: must not be 0 (root)")
    return found
