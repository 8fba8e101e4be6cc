package exclude

import (
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// commLen is the most bytes of a name that /proc/PID/stat's comm keeps
// (TASK_COMM_LEN 16, less the NUL): "nvidia-persistenced" runs as
// "nvidia-persiste", "containerd-shim-runc-v2" as "containerd-shim".
const commLen = 15

// DefaultProtected are the processes no policy may touch, whatever they
// hold: the node's GPU and container plumbing, display servers, remote
// access, init, and our own binaries. An entry is a name pattern, matched
// against the name of the executable (an exact name, or a prefix ending in
// "*", case-sensitive), or the absolute path of an executable (see
// Rules.Protected for what each protects).
var DefaultProtected = slices.Concat(defaultNames, defaultPaths)

var defaultNames = []string{
	// NVIDIA's daemons and tools. The MPS server owns its clients' memory.
	// Fabric Manager's package and service are nvidia-fabricmanager, its
	// binary nv-fabricmanager (comm "nv-fabricmanage").
	"nvidia-persistenced",
	"nv-fabricmanager",
	"nvidia-fabricmanager",
	"nvidia-powerd",
	"nvidia-cuda-mps*",
	"nvidia-smi",
	"nvidia-container*",
	"nvidia-device-plugin",
	"gpu-feature-discovery",
	"nv-hostengine",
	"dcgm*", // dcgm, dcgmi, dcgm-exporter
	// Display servers and sessions hold the GPU of a workstation.
	"Xorg",
	"Xwayland",
	"gdm*",
	"sddm",
	"lightdm",
	"gnome-shell",
	"kwin_wayland",
	"kwin_x11",
	// Remote access and logins.
	"sshd*", // sshd, and OpenSSH 9.8's sshd-session, sshd-auth
	"login",
	"agetty",
	// Kubernetes, containers and schedulers.
	"kubelet",
	"k3s*",
	"containerd*", // containerd, containerd-shim*
	"dockerd",
	"docker",
	"docker-proxy",
	"runc",
	"crun",
	"crio",
	"conmon",
	"podman",
	"pause",
	"tini",
	"dumb-init",
	"slurmd",
	"slurmstepd",
	"slurmctld",
	// The system itself.
	"systemd*", // systemd, systemd-journald, systemd-udevd, ...
	"init",
	"dbus-daemon",
	"dbus-broker",
	// Ourselves: gpu-orphan, gpu-orphan-exporter, gpu-orphan-remediator
	// (comm keeps 15 bytes). Not gpu-orphan-sim: its workloads stand in for
	// trainers and must be cleanable.
	"gpu-orphan",
	"gpu-orphan-expo*",
	"gpu-orphan-reme*",
}

// defaultPaths are where NVIDIA's packages install the daemons that own
// GPU memory or must never lose it; those that do not exist on a node are
// ignored.
var defaultPaths = inDirs([]string{"/usr/bin", "/usr/sbin"},
	"nvidia-persistenced",
	"nv-fabricmanager",
	"nvidia-fabricmanager",
	"nvidia-powerd",
	"nvidia-cuda-mps-control",
	"nvidia-cuda-mps-server",
	"nv-hostengine",
	"dcgmi",
	"dcgm-exporter",
)

func inDirs(dirs []string, names ...string) []string {
	var paths []string
	for _, d := range dirs {
		for _, n := range names {
			paths = append(paths, d+"/"+n)
		}
	}
	return paths
}

// IsPath reports whether a Protected entry is the path of an executable
// rather than a name pattern.
func IsPath(entry string) bool { return strings.HasPrefix(entry, "/") }

// protectedFiles are the executables that Rules.Protected names by path,
// as the kernel knows them when the rules are built.
type protectedFiles struct {
	// ids are the files themselves, symlinks followed: whatever name a
	// process exec'd one by (a hard link, a symlink), it runs that file.
	ids map[proc.FileID]bool
	// paths are the entries, cleaned, and where their symlinks lead: the
	// paths /proc/PID/exe shows for them.
	paths map[string]bool
}

// statProtected stats the path entries of protected. Missing files are
// left out: a daemon that is not installed runs nowhere.
func statProtected(protected []string) protectedFiles {
	f := protectedFiles{ids: map[proc.FileID]bool{}, paths: map[string]bool{}}
	for _, e := range protected {
		if !IsPath(e) {
			continue
		}
		p := filepath.Clean(e)
		f.paths[p] = true
		if real, err := filepath.EvalSymlinks(p); err == nil {
			f.paths[real] = true
		}
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err == nil {
			f.ids[proc.FileID{Dev: st.Dev, Ino: st.Ino}] = true
		}
	}
	return f
}

// protectedExe reports whether the executable e is protected:
//
//   - it is the very file (st_dev, st_ino) of a protected path, by
//     whatever name the process exec'd it; or
//   - its file can only have been put there by root (or by the user the
//     remediator runs as), and its name matches a pattern, or its path is
//     a protected path. A file removed or replaced since the process
//     exec'd it (" (deleted)", a package upgrade) keeps its name.
//
// What the process calls itself (comm, argv) plays no part: anyone can
// rename a process, and anyone can copy a binary under a daemon's name.
func (r Rules) protectedExe(e proc.Exe) bool {
	if r.files.ids[e.File] {
		return true
	}
	if !r.trusted(e) {
		return false
	}
	if p := e.ExecPath(); p != "" && r.files.paths[filepath.Clean(p)] {
		return true
	}
	for _, entry := range r.Protected {
		if !IsPath(entry) && matchName(entry, e.Name()) {
			return true
		}
	}
	return false
}

// trusted reports whether only root, or the remediator's own user, can
// have made e what it is: a regular file that they own and that neither
// its group nor others may write. A user's copy of a binary is theirs.
func (r Rules) trusted(e proc.Exe) bool {
	return e.Mode&unix.S_IFMT == unix.S_IFREG && e.Mode&0o022 == 0 && (e.UID == 0 || e.UID == r.Self.UID)
}

// protectedComm reports whether a process whose executable is unknown is
// protected by its comm: when /proc will not say what it runs, a name
// that looks like a daemon's is enough doubt not to signal it. A path
// entry counts by its base name.
func protectedComm(comm string, protected []string) bool {
	for _, entry := range protected {
		if IsPath(entry) {
			entry = filepath.Base(entry)
		}
		if matchComm(entry, comm) {
			return true
		}
	}
	return false
}

// matchName matches one pattern against the name of an executable. The
// name is whole, but a pattern of exactly 15 bytes may have been copied
// from a comm (ps, top): it matches the names it could be the start of,
// as it matched their comm.
func matchName(pattern, name string) bool {
	if pattern == "" || name == "" {
		return false
	}
	if prefix, ok := strings.CutSuffix(pattern, "*"); ok {
		return strings.HasPrefix(name, prefix)
	}
	return name == pattern || len(pattern) == commLen && strings.HasPrefix(name, pattern)
}

// matchComm matches one pattern against a comm, allowing for the kernel's
// truncation of comm to 15 bytes: without it a long name such as
// "nvidia-persistenced" would never match.
func matchComm(pattern, comm string) bool {
	if pattern == "" || comm == "" {
		return false
	}
	if prefix, ok := strings.CutSuffix(pattern, "*"); ok {
		if len(prefix) > commLen {
			prefix = prefix[:commLen]
		}
		return strings.HasPrefix(comm, prefix)
	}
	if comm == pattern {
		return true
	}
	return len(pattern) > commLen && len(comm) == commLen && pattern[:commLen] == comm
}
