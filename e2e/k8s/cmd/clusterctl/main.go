// Command clusterctl is the small client `make up` uses instead of kubectl (which the harness does not
// build): PKI and kubeconfigs, readiness waits, server-side apply and the per-pod report.
package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"tessera.dev/e2e/internal/cluster"
)

const usage = `usage: clusterctl <command> [flags]
commands:
  pki            --dir D --server URL --identities name=user[@group+group],...
  sign-cert      --dir D --out PREFIX --cn CN [--ips IP,...] [--dns NAME,...] [--client]
                 (a serving certificate signed by the CA pki wrote in D; --client: for client auth too)
  wait-url       --url URL [--timeout 60s]            (2xx over http, or https without verification)
  wait-api       --kubeconfig K [--timeout 60s]       (/readyz)
  wait-node      --kubeconfig K --node N              (Ready, no taints)
  wait-inventory --kubeconfig K --node N              (NodeInventory ready)
  wait-slices    --kubeconfig K --node N              (ResourceSlices of gpu.tessera.dev for the node)
  apply          --kubeconfig K [--namespace default] [--node N: pin every pod to node N] PATH...
  host-rbac      --kubeconfig K --namespace NS --controller USER [--plugins U,...] FILE
                 (the chart's roles from FILE, helm template output, bound to make up's host processes)
  report         --kubeconfig K [--wait 120s]`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	if err := run(context.Background(), os.Args[1], os.Args[2:]); err != nil {
		fmt.Fprintf(os.Stderr, "clusterctl %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cmd string, args []string) error {
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	kubeconfig := fs.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig")
	timeout := fs.Duration("timeout", 60*time.Second, "how long to wait")
	node := fs.String("node", "", "node name")
	dir := fs.String("dir", "", "output directory")
	server := fs.String("server", "", "API server URL")
	identities := fs.String("identities", "", "name=user[@group+group],...")
	url := fs.String("url", "", "URL to poll")
	namespace := fs.String("namespace", "default", "namespace for namespaced objects without one")
	waitFor := fs.Duration("wait", 0, "wait this long for pods to settle before reporting")
	controllerUser := fs.String("controller", "", "the host controller's user (host-rbac)")
	pluginUsers := fs.String("plugins", "", "the host plugins' users, comma-separated (host-rbac)")
	out := fs.String("out", "", "output path without .crt/.key (sign-cert)")
	commonName := fs.String("cn", "", "certificate common name (sign-cert)")
	ips := fs.String("ips", "", "IP addresses the certificate names, comma-separated (sign-cert)")
	dnsNames := fs.String("dns", "", "DNS names the certificate names, comma-separated (sign-cert)")
	clientAuth := fs.Bool("client", false, "the certificate is for client authentication too (sign-cert)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	client := func() (*rest.Config, kubernetes.Interface, error) {
		cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
		if err != nil {
			return nil, nil, fmt.Errorf("failed to load kubeconfig %q: %w", *kubeconfig, err)
		}
		c, err := kubernetes.NewForConfig(cfg)
		return cfg, c, err
	}
	switch cmd {
	case "pki":
		var ids []cluster.Identity
		for _, kv := range strings.Split(*identities, ",") {
			name, user, ok := strings.Cut(kv, "=")
			if !ok {
				return fmt.Errorf("--identities entry %q is not name=user or name=user@group+group", kv)
			}
			id := cluster.Identity{Name: name, User: user}
			// user@g1+g2 puts the identity in those groups only (user@: in none) instead of system:masters.
			if u, groups, ok := strings.Cut(user, "@"); ok {
				id.User, id.Groups = u, []string{}
				for _, g := range strings.Split(groups, "+") {
					if g != "" {
						id.Groups = append(id.Groups, g)
					}
				}
			}
			ids = append(ids, id)
		}
		return cluster.WritePKI(*dir, *server, ids)
	case "sign-cert":
		if *dir == "" || *out == "" || *commonName == "" {
			return fmt.Errorf("--dir, --out and --cn are required")
		}
		var addrs []net.IP
		for _, s := range strings.Split(*ips, ",") {
			if s == "" {
				continue
			}
			ip := net.ParseIP(s)
			if ip == nil {
				return fmt.Errorf("--ips entry %q is not an IP address", s)
			}
			addrs = append(addrs, ip)
		}
		var names []string
		for _, s := range strings.Split(*dnsNames, ",") {
			if s != "" {
				names = append(names, s)
			}
		}
		return cluster.SignCert(*dir, *out, *commonName, addrs, names, *clientAuth)
	case "wait-url":
		hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
			// Component health endpoints serve self-signed certificates; only liveness matters here.
			TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, //nolint:gosec
		}}
		var last string
		err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, *timeout, true, func(ctx context.Context) (bool, error) {
			resp, err := hc.Get(*url)
			if err != nil {
				last = err.Error()
				return false, nil
			}
			resp.Body.Close()
			last = resp.Status
			return resp.StatusCode >= 200 && resp.StatusCode < 300, nil
		})
		if err != nil {
			return fmt.Errorf("%s not healthy after %s (last: %s)", *url, *timeout, last)
		}
		return nil
	case "wait-api":
		_, c, err := client()
		if err != nil {
			return err
		}
		var last string
		err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, *timeout, true, func(ctx context.Context) (bool, error) {
			body, err := c.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
			if err != nil {
				last = err.Error()
				return false, nil
			}
			return string(body) == "ok", nil
		})
		if err != nil {
			return fmt.Errorf("API server not ready after %s (last: %s)", *timeout, last)
		}
		return nil
	case "wait-node":
		_, c, err := client()
		if err != nil {
			return err
		}
		err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, *timeout, true, func(ctx context.Context) (bool, error) {
			n, err := c.CoreV1().Nodes().Get(ctx, *node, metav1.GetOptions{})
			if err != nil || len(n.Spec.Taints) > 0 {
				return false, nil
			}
			for _, cond := range n.Status.Conditions {
				if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
					return true, nil
				}
			}
			return false, nil
		})
		if err != nil {
			return fmt.Errorf("node %s not Ready and untainted after %s", *node, *timeout)
		}
		return nil
	case "wait-inventory":
		cfg, _, err := client()
		if err != nil {
			return err
		}
		dyn, err := dynamic.NewForConfig(cfg)
		if err != nil {
			return err
		}
		gvr := schema.GroupVersionResource{Group: "gpu.tessera.dev", Version: "v1alpha1", Resource: "nodeinventories"}
		var last string
		err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, *timeout, true, func(ctx context.Context) (bool, error) {
			u, err := dyn.Resource(gvr).Get(ctx, *node, metav1.GetOptions{})
			if err != nil {
				last = err.Error()
				return false, nil
			}
			ready, _, _ := unstructuredBool(u.Object, "status", "ready")
			last = fmt.Sprintf("status.ready=%v", ready)
			return ready, nil
		})
		if err != nil {
			return fmt.Errorf("NodeInventory %s not ready after %s (last: %s)", *node, *timeout, last)
		}
		return nil
	case "wait-slices":
		_, c, err := client()
		if err != nil {
			return err
		}
		devices := 0
		err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, *timeout, true, func(ctx context.Context) (bool, error) {
			slices, err := c.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + *node + ",spec.driver=" + cluster.DriverName})
			if err != nil {
				return false, nil
			}
			// A pool is complete when all resourceSliceCount slices of its newest generation exist.
			var gen int64
			for _, s := range slices.Items {
				gen = max(gen, s.Spec.Pool.Generation)
			}
			count, want := 0, int64(0)
			devices = 0
			for _, s := range slices.Items {
				if s.Spec.Pool.Generation == gen {
					count++
					want = s.Spec.Pool.ResourceSliceCount
					devices += len(s.Spec.Devices)
				}
			}
			return count > 0 && int64(count) == want && devices > 0, nil
		})
		if err != nil {
			return fmt.Errorf("no ResourceSlices of %s for node %s after %s", cluster.DriverName, *node, *timeout)
		}
		fmt.Printf("%d devices\n", devices)
		return nil
	case "apply":
		cfg, _, err := client()
		if err != nil {
			return err
		}
		files, err := cluster.ManifestFiles(fs.Args()...)
		if err != nil {
			return err
		}
		objs, err := cluster.ReadManifests(files...)
		if err != nil {
			return err
		}
		if *node != "" {
			if err := cluster.PinToNode(objs, *node); err != nil {
				return err
			}
		}
		a, err := cluster.NewApplier(cfg)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(ctx, *timeout*2)
		defer cancel()
		if err := a.Apply(ctx, objs, *namespace); err != nil {
			return err
		}
		fmt.Printf("%d objects from %d files\n", len(objs), len(files))
		return nil
	case "host-rbac":
		cfg, _, err := client()
		if err != nil {
			return err
		}
		if *controllerUser == "" || fs.NArg() != 1 {
			return fmt.Errorf("needs --controller USER and one file of rendered chart RBAC\n%s", usage)
		}
		data, err := os.ReadFile(fs.Arg(0))
		if err != nil {
			return err
		}
		chart, err := cluster.Decode(data)
		if err != nil {
			return fmt.Errorf("%s: %w", fs.Arg(0), err)
		}
		var plugins []string
		if *pluginUsers != "" {
			plugins = strings.Split(*pluginUsers, ",")
		}
		objs, err := cluster.HostRBAC(chart, *namespace, *controllerUser, plugins)
		if err != nil {
			return err
		}
		a, err := cluster.NewApplier(cfg)
		if err != nil {
			return err
		}
		if err := a.Apply(ctx, objs, *namespace); err != nil {
			return err
		}
		fmt.Printf("%d objects: the chart's roles bound to %s and %d plugin(s)\n", len(objs), *controllerUser, len(plugins))
		return nil
	case "report":
		_, c, err := client()
		if err != nil {
			return err
		}
		if *waitFor > 0 {
			if err := cluster.WaitSettled(ctx, c, *waitFor); err != nil {
				fmt.Fprintf(os.Stderr, "warning: pods still settling after %s\n", *waitFor)
			}
		}
		notRunning, err := cluster.Report(ctx, c, os.Stdout)
		if err != nil {
			return err
		}
		if notRunning > 0 {
			fmt.Printf("%d pod(s) not Running (see 'why' above)\n", notRunning)
		}
		return nil
	default:
		return fmt.Errorf("unknown command\n%s", usage)
	}
}

func unstructuredBool(obj map[string]any, path ...string) (bool, bool, error) {
	cur := any(obj)
	for _, p := range path {
		m, ok := cur.(map[string]any)
		if !ok {
			return false, false, nil
		}
		cur = m[p]
	}
	b, ok := cur.(bool)
	return b, ok, nil
}
