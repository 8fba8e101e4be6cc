package proc

import (
	"strings"

	"github.com/prometheus/procfs"
)

// cgroupPath picks the path that names the process's cgroup among the lines
// of /proc/PID/cgroup: the cgroup v2 ("0::") path, else the first v1 path.
// On hybrid hosts the v2 path is often "/" while the v1 controllers carry
// the real placement, so a v2 "/" gives way to the first v1 path that is
// not "/".
func cgroupPath(cgs []procfs.Cgroup) string {
	v2, hasV2 := "", false
	for _, cg := range cgs {
		if cg.HierarchyID == 0 && len(cg.Controllers) == 0 {
			v2, hasV2 = cg.Path, true
			break
		}
	}
	if hasV2 && v2 != "/" {
		return v2
	}
	for _, cg := range cgs {
		if cg.HierarchyID != 0 && cg.Path != "/" {
			return cg.Path
		}
	}
	if hasV2 {
		return v2
	}
	if len(cgs) > 0 {
		return cgs[0].Path
	}
	return ""
}

// containerScopes are the prefixes container runtimes give a container's
// cgroup ("<prefix><id>.scope" with the systemd driver, "<prefix><id>" with
// cgroupfs). "crio-conmon-<id>" is CRI-O's monitor, not the container: its
// rest is not an ID, so it does not match.
var containerScopes = []string{"docker-", "cri-containerd-", "crio-", "libpod-"}

// parseContainer returns the container ID and the Kubernetes pod UID named
// by a cgroup path, or "" for each that it does not name. It knows:
//
//	/docker/<id>                                   docker, cgroupfs driver
//	/system.slice/docker-<id>.scope                docker, systemd driver
//	.../cri-containerd-<id>.scope, .../crio-<id>.scope, .../libpod-<id>.scope
//	/kubepods.slice/kubepods-<qos>-pod<uid_with_underscores>.slice/...
//	/kubepods/<qos>/pod<uid>/<id>                  kubelet, cgroupfs driver
//
// IDs are kept whole (64 hex digits), not cut to docker's 12. When
// containers nest (kind, docker-in-docker), the innermost one wins.
func parseContainer(path string) (container, pod string) {
	inKubepods := false
	prevPod := false // the previous segment was a cgroupfs "pod<uid>"
	prevDocker := false
	for seg := range strings.SplitSeq(path, "/") {
		wasPod, wasDocker := prevPod, prevDocker
		prevPod, prevDocker = false, false
		switch {
		case seg == "":
			continue
		case (wasPod || wasDocker) && isContainerID(seg):
			container = seg
			continue
		case seg == "docker":
			prevDocker = true
			continue
		case strings.HasPrefix(seg, "kubepods"):
			inKubepods = true
		}
		if name, ok := strings.CutSuffix(seg, ".slice"); ok {
			// kubepods-burstable-pod<uid>.slice; systemd escapes the
			// UID's dashes as underscores.
			if strings.Contains(name, "kubepods") {
				inKubepods = true
				last := name[strings.LastIndexByte(name, '-')+1:]
				if uid, ok := strings.CutPrefix(last, "pod"); ok {
					if uid = strings.ReplaceAll(uid, "_", "-"); isPodUID(uid) {
						pod = uid
					}
				}
			}
			continue
		}
		if uid, ok := strings.CutPrefix(seg, "pod"); ok && inKubepods && isPodUID(uid) {
			pod = uid
			prevPod = true
			continue
		}
		name := strings.TrimSuffix(seg, ".scope")
		for _, prefix := range containerScopes {
			if id, ok := strings.CutPrefix(name, prefix); ok && isContainerID(id) {
				container = id
				break
			}
		}
	}
	return container, pod
}

// isContainerID reports whether s is a full container ID: 64 lowercase hex
// digits, as docker, containerd and CRI-O generate them.
func isContainerID(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isHex(s[i]) {
			return false
		}
	}
	return true
}

// isPodUID accepts a pod's UID: a UUID (36 chars) or, for a static pod,
// the 32 hex digits of its manifest hash.
func isPodUID(s string) bool {
	if len(s) != 32 && len(s) != 36 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isHex(s[i]) && s[i] != '-' {
			return false
		}
	}
	return true
}

func isHex(c byte) bool { return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' }
