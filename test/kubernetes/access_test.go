//go:build kubernetes

package kubernetes

import (
	"fmt"
	"strings"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
)

// waitNodeAccess waits until kube-apiserver's authorizer says that the
// ServiceAccount namespace/name may (allowed) or may not do each of verbs
// on the Node node, as a SubjectAccessReview made by the admin asks it.
// The RBAC authorizer reads Roles and bindings from an informer cache: a
// binding created or deleted takes effect a moment later, not at once.
// The review goes through the same authorizer as the ServiceAccount's own
// requests, so once it answers, they are answered alike.
func waitNodeAccess(t *testing.T, cp *kubereal.ControlPlane, namespace, name, node string, allowed bool, verbs ...string) {
	t.Helper()
	admin := cp.Admin(t)
	spec := authorizationv1.SubjectAccessReviewSpec{
		User:   "system:serviceaccount:" + namespace + ":" + name,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"},
	}
	want := map[bool]string{true: "allowed", false: "denied"}[allowed]
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("%s to be %s %s on node %s", spec.User, want, strings.Join(verbs, ", "), node), func() bool {
		for _, verb := range verbs {
			review := &authorizationv1.SubjectAccessReview{Spec: spec}
			review.Spec.ResourceAttributes = &authorizationv1.ResourceAttributes{Verb: verb, Resource: "nodes", Name: node}
			r, err := admin.AuthorizationV1().SubjectAccessReviews().Create(t.Context(), review, metav1.CreateOptions{})
			if err != nil {
				t.Fatalf("SubjectAccessReview of %s on nodes for %s: %v", verb, spec.User, err)
			}
			if r.Status.Allowed != allowed {
				return false
			}
		}
		return true
	})
}
