package proc

import (
	"strings"
	"testing"

	"github.com/prometheus/procfs"
)

func TestParseContainer(t *testing.T) {
	const (
		id  = "3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c"
		id2 = "a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4"
		uid = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
		us  = "1b4e28ba_2fa1_11d2_883f_0016d3cca427" // as systemd escapes it
	)
	tests := []struct {
		name, path     string
		container, pod string
	}{
		{"root", "/", "", ""},
		{"empty", "", "", ""},
		{"systemd service", "/system.slice/cron.service", "", ""},
		{"user session", "/user.slice/user-1000.slice/session-3.scope", "", ""},
		{"docker cgroupfs", "/docker/" + id, id, ""},
		{"docker systemd", "/system.slice/docker-" + id + ".scope", id, ""},
		{"docker short id is not an id", "/docker/3f4e2d1c3f4e", "", ""},
		{"docker uppercase is not an id", "/docker/" + strings.ToUpper(id), "", ""},
		{"containerd", "/system.slice/cri-containerd-" + id + ".scope", id, ""},
		{"crio", "/machine.slice/crio-" + id + ".scope", id, ""},
		{"crio conmon is not the container", "/machine.slice/crio-conmon-" + id + ".scope", "", ""},
		{"podman", "/machine.slice/libpod-" + id + ".scope", id, ""},
		{"kubepods containerd", "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + us + ".slice/cri-containerd-" + id + ".scope", id, uid},
		{"kubepods crio besteffort", "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + us + ".slice/crio-" + id + ".scope", id, uid},
		{"kubepods guaranteed", "/kubepods.slice/kubepods-pod" + us + ".slice/cri-containerd-" + id + ".scope", id, uid},
		{"kubepods pod only", "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + us + ".slice", "", uid},
		{"kubepods cgroupfs", "/kubepods/burstable/pod" + uid + "/" + id, id, uid},
		{"kubepods cgroupfs guaranteed", "/kubepods/pod" + uid + "/" + id, id, uid},
		{"kubepods cgroupfs crio", "/kubepods/burstable/pod" + uid + "/crio-" + id, id, uid},
		{"static pod hash", "/kubepods/burstable/pode1f2c3d4a5b6978812345678deadbeef/" + id, id, "e1f2c3d4a5b6978812345678deadbeef"},
		{"pod outside kubepods is not a pod", "/pod" + uid + "/" + id, "", ""},
		{"kind: innermost wins", "/system.slice/docker-" + id2 + ".scope/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod" + us + ".slice/cri-containerd-" + id + ".scope", id, uid},
		{"docker in docker", "/docker/" + id2 + "/docker/" + id, id, ""},
		{"hybrid v1 name", "/system.slice/docker-" + id + ".scope/init", id, ""},
		// The kubelet's pod cgroups from the root (or a container's root),
		// never in a user's delegated subtree, where anyone makes them.
		{"user's subtree, systemd driver", "/user.slice/user-1000.slice/user@1000.service/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + us + ".slice/cri-containerd-" + id + ".scope", id, ""},
		{"user's subtree, cgroupfs driver", "/user.slice/user-1000.slice/user@1000.service/kubepods/burstable/pod" + uid + "/" + id, id, ""},
		{"user's subtree, pod slice alone", "/user.slice/user-1000.slice/user@1000.service/kubepods-pod" + us + ".slice", "", ""},
		{"user's rootless kind", "/user.slice/user-1000.slice/user@1000.service/user.slice/docker-" + id2 + ".scope/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod" + us + ".slice/cri-containerd-" + id + ".scope", id, ""},
		{"under a service", "/system.slice/cron.service/kubepods.slice/kubepods-pod" + us + ".slice", "", ""},
		{"under a service, cgroupfs", "/system.slice/cron.service/kubepods/pod" + uid + "/" + id, id, ""},
		{"pod slice without its parents", "/kubepods-burstable-pod" + us + ".slice", "", ""},
		{"pod slice in the wrong parent", "/kubepods.slice/kubepods-besteffort.slice/kubepods-burstable-pod" + us + ".slice", "", ""},
		{"pod slice in a scope", "/kubepods.slice/x.scope/kubepods-pod" + us + ".slice", "", ""},
		// Relative to a reader's cgroup namespace (the exporter's pod):
		// the parents above the common ancestor are the reader's own.
		{"relative, from another pod", "/../../../kubepods-besteffort.slice/kubepods-besteffort-pod" + us + ".slice/cri-containerd-" + id + ".scope", id, uid},
		{"relative, same QoS", "/../../kubepods-besteffort-pod" + us + ".slice/cri-containerd-" + id + ".scope", id, uid},
		{"relative, from the root", "/../../../../kubepods.slice/kubepods-pod" + us + ".slice", "", uid},
		{"relative, wrong parent", "/../../foo.slice/kubepods-besteffort-pod" + us + ".slice", "", ""},
		{"relative, user's subtree", "/../../../../user.slice/user-1000.slice/user@1000.service/kubepods.slice/kubepods-pod" + us + ".slice", "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, p := parseContainer(tt.path)
			if c != tt.container || p != tt.pod {
				t.Errorf("parseContainer(%q) = %q, %q; want %q, %q", tt.path, c, p, tt.container, tt.pod)
			}
		})
	}
}

func TestCgroupPath(t *testing.T) {
	v2 := func(path string) procfs.Cgroup { return procfs.Cgroup{Path: path} }
	v1 := func(id int, ctl, path string) procfs.Cgroup {
		return procfs.Cgroup{HierarchyID: id, Controllers: strings.Split(ctl, ","), Path: path}
	}
	tests := []struct {
		name string
		cgs  []procfs.Cgroup
		want string
	}{
		{"none", nil, ""},
		{"v2", []procfs.Cgroup{v2("/system.slice/cron.service")}, "/system.slice/cron.service"},
		{"v2 root", []procfs.Cgroup{v2("/")}, "/"},
		{"v1", []procfs.Cgroup{v1(12, "pids", "/docker/x"), v1(11, "memory", "/docker/x")}, "/docker/x"},
		{"hybrid, v2 says more", []procfs.Cgroup{v1(4, "memory", "/docker/x"), v2("/system.slice/docker-x.scope")}, "/system.slice/docker-x.scope"},
		{"hybrid, v2 root", []procfs.Cgroup{v1(9, "name=systemd", "/"), v1(4, "memory", "/job/1"), v2("/")}, "/job/1"},
		{"hybrid, all root", []procfs.Cgroup{v1(4, "memory", "/"), v2("/")}, "/"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := cgroupPath(tt.cgs); got != tt.want {
				t.Errorf("cgroupPath = %q, want %q", got, tt.want)
			}
		})
	}
}

func FuzzParseCgroup(f *testing.F) {
	for _, s := range []string{
		"/",
		"/docker/3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c",
		"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/cri-containerd-3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c.scope",
		"/kubepods/burstable/pod1b4e28ba-2fa1-11d2-883f-0016d3cca427/3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c",
		"/kubepods.slice/kubepods-pod.slice/crio-.scope",
		"kubepods-pod-.slice//docker/",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, path string) {
		c, p := parseContainer(path)
		if c != "" && (!isContainerID(c) || !strings.Contains(path, c)) {
			t.Errorf("container %q from %q", c, path)
		}
		if p != "" && (!isPodUID(p) || !strings.Contains(strings.ReplaceAll(path, "_", "-"), p)) {
			t.Errorf("pod %q from %q", p, path)
		}
		if j, s := parseSlurm(path); j != "" && (!isDigits(j) || !strings.Contains(path, "job_"+j)) || s != "" && (j == "" || !isStep(s)) {
			t.Errorf("Slurm job %q, step %q from %q", j, s, path)
		}
	})
}
