package kubereal

import (
	"os"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

func TestMain(m *testing.M) { os.Exit(Main(m)) }

// TestControlPlane: the admin's token is a cluster admin; a
// ServiceAccount's token from the TokenRequest API authenticates as that
// account, and the RBAC authorizer refuses it what no binding grants.
func TestControlPlane(t *testing.T) {
	c := Get(t)
	t.Logf("Kubernetes %s started in %s", c.Version, c.StartedIn)
	admin := c.Admin(t)
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kubereal-smoke"}}
	if _, err := admin.CoreV1().Namespaces().Create(t.Context(), ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "nobody", Namespace: ns.Name}}
	if _, err := admin.CoreV1().ServiceAccounts(ns.Name).Create(t.Context(), sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(c.TokenConfig(c.ServiceAccountToken(t, ns.Name, "nobody")))
	if err != nil {
		t.Fatal(err)
	}
	_, err = cs.CoreV1().Pods(ns.Name).List(t.Context(), metav1.ListOptions{})
	if !apierrors.IsForbidden(err) {
		t.Fatalf("a ServiceAccount without a binding listed pods: %v, want 403 Forbidden", err)
	}
	if st, ok := err.(apierrors.APIStatus); !ok || st.Status().Details == nil {
		t.Logf("forbidden: %v", err)
	}
	if want := "system:serviceaccount:" + ns.Name + ":nobody"; !strings.Contains(err.Error(), want) {
		t.Errorf("the refusal does not name %s: %v", want, err)
	}
	if !c.Healthy() {
		t.Error("kube-apiserver's /readyz is not ok")
	}
}
