package proc

import (
	"slices"
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
//	/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_with_underscores>.slice/...
//	/kubepods/<qos>/pod<uid>/<id>                  kubelet, cgroupfs driver
//
// IDs are kept whole (64 hex digits), not cut to docker's 12. When
// containers nest (kind, docker-in-docker), the innermost one wins. The
// pod is parsePod's: anchored, never under a user's delegated subtree.
func parseContainer(path string) (container, pod string) {
	segs, _ := cgroupSegments(path)
	for i := range segs {
		if id := containerAt(segs, i); id != "" {
			container = id
		}
	}
	return container, parsePod(path)
}

// containerAt returns the container ID that segs[i] names, or "".
func containerAt(segs []string, i int) string {
	seg := segs[i]
	if i > 0 && isContainerID(seg) && (segs[i-1] == "docker" || isCgroupfsPod(segs[i-1]) && slices.ContainsFunc(segs[:i-1], isKubepods)) {
		return seg
	}
	name := strings.TrimSuffix(seg, ".scope")
	for _, prefix := range containerScopes {
		if id, ok := strings.CutPrefix(name, prefix); ok && isContainerID(id) {
			return id
		}
	}
	return ""
}

func isKubepods(seg string) bool { return strings.HasPrefix(seg, "kubepods") }

func isCgroupfsPod(seg string) bool {
	uid, ok := strings.CutPrefix(seg, "pod")
	return ok && isPodUID(uid)
}

// cgroupSegments splits a cgroup path into its names. A reader in a
// cgroup namespace of its own (a container's) sees the cgroups outside it
// relative to its namespace's root: the path starts with "..", up times.
// A path with ".." elsewhere names nothing (the kernel writes none there).
func cgroupSegments(path string) (segs []string, up int) {
	for seg := range strings.SplitSeq(path, "/") {
		switch seg {
		case "":
		case "..":
			if len(segs) > 0 {
				return nil, 0
			}
			up++
		default:
			segs = append(segs, seg)
		}
	}
	return segs, up
}

// cgroupAnchors are the positions in segs where a hierarchy that root
// made, slurmd's or the kubelet's, may begin: the root (for a relative
// path, the reader's ancestor where it begins), and the root of each
// container (a container runtime's scope: kind, or slurmd in a pod). None
// lies in or under a user's delegated subtree (user.slice,
// user@UID.service), where a user creates cgroups of any name: the
// Slurm job or the pod that such a path seems to name is anyone's
// invention.
func cgroupAnchors(segs []string) []int {
	anchors := []int{0}
	for i, seg := range segs {
		if isUserSubtree(seg) {
			break
		}
		if containerAt(segs, i) != "" {
			anchors = append(anchors, i+1)
		}
	}
	return anchors
}

// isUserSubtree reports whether a cgroup named seg is, or lies on the way
// to, a user's delegated subtree: systemd's user.slice, and the
// user@UID.service it delegates to the user.
func isUserSubtree(seg string) bool {
	return seg == "user.slice" || strings.HasPrefix(seg, "user@") && strings.HasSuffix(seg, ".service")
}

// parsePod returns the UID of the Kubernetes pod that a cgroup path names,
// with the kubelet's pod cgroup at its place: at an anchor (cgroupAnchors),
//
//	kubepods/[<qos>/]pod<uid>                                   cgroupfs driver
//	kubepods.slice/[kubepods-<qos>.slice/]kubepods-[<qos>-]pod<uid>.slice    systemd driver
//	<root>.slice/<root>-kubepods.slice/...                      systemd driver, --cgroup-root (kind)
//
// systemd names a slice after its parents ("a-b-c.slice" sits in
// "a-b.slice" in "a.slice"), so the pod slice's name says where it must
// be; a path relative to the reader may start below its top. A pod's
// cgroup anywhere else, under a user's delegated subtree in particular,
// names no pod.
func parsePod(path string) string {
	segs, up := cgroupSegments(path)
	pod := ""
	for _, a := range cgroupAnchors(segs) {
		if uid := cgroupfsPodAt(segs[a:]); uid != "" {
			pod = uid
		}
		if uid := systemdPodAt(segs[a:], a == 0 && up > 0); uid != "" {
			pod = uid
		}
	}
	return pod
}

// cgroupfsPodAt matches kubepods/[burstable|besteffort/]pod<uid> at the
// start of segs.
func cgroupfsPodAt(segs []string) string {
	if len(segs) < 2 || segs[0] != "kubepods" {
		return ""
	}
	i := 1
	if segs[i] == "burstable" || segs[i] == "besteffort" {
		i++
	}
	if i < len(segs) && isCgroupfsPod(segs[i]) {
		return segs[i][len("pod"):]
	}
	return ""
}

// systemdPodAt finds a pod slice in segs whose parents, by its name, are
// the slices before it from the start of segs; partial allows the first
// of them to be hidden above the start (a path relative to the reader).
func systemdPodAt(segs []string, partial bool) string {
	for p, seg := range segs {
		name, ok := strings.CutSuffix(seg, ".slice")
		if !ok {
			return "" // slices nest in slices only
		}
		parts := strings.Split(name, "-")
		uid, ok := strings.CutPrefix(parts[len(parts)-1], "pod")
		if !ok || len(parts) < 2 || !slices.Contains(parts[:len(parts)-1], "kubepods") {
			continue
		}
		uid = strings.ReplaceAll(uid, "_", "-")
		if !isPodUID(uid) {
			continue
		}
		// The parents: parts[:1], parts[:2], ... up to the pod slice.
		top := p - (len(parts) - 1)
		if top < 0 && !partial || top > 0 {
			return ""
		}
		for k := max(top, 0); k < p; k++ {
			if segs[k] != strings.Join(parts[:k-top+1], "-")+".slice" {
				return ""
			}
		}
		return uid
	}
	return ""
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
