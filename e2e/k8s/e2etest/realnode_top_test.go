package e2etest

// Issue 41 item 2 on the real node: `kubectl tessera top --node <real node>` drawn in a real terminal
// (a detached tmux session of 80 columns, read back with capture-pane) while a whole GPU, a MIG device and a
// share are held: the whole GPU's pod, the MIG profile in its slice bar, the share's request and ceiling,
// use read through the API server's pod proxy from the plugin, and no line wider than the terminal.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// inTerminal runs `kubectl tessera ARGS...` in a detached tmux session `cols` wide and returns the screen
// and its scrollback, wrapped lines joined (-J) so a line wider than the terminal shows as one.
func inTerminal(t *testing.T, cols int, args ...string) string {
	t.Helper()
	tmux, err := exec.LookPath("tmux")
	if err != nil {
		t.Fatalf("tmux is missing (apt-get install tmux): this scenario reads top through a real terminal: %v", err)
	}
	target := getenv("CARGO_TARGET_DIR", filepath.Join(e.repoRoot, "target"))
	plugin := filepath.Join(target, "debug", "kubectl-tessera")
	if _, err := os.Stat(plugin); err != nil {
		t.Fatalf("%s is missing: run cargo build -p tessera-controller (%v)", plugin, err)
	}
	kubectl := filepath.Join(getenv("E2E_BIN_DIR", filepath.Join(e.repoRoot, "e2e", "bin")), "kubectl")
	// A server of its own (-L), so a user's tmux is neither read nor touched.
	socket := fmt.Sprintf("tessera-e2e-top-%d", os.Getpid())
	run := func(ctx context.Context, a ...string) (string, error) {
		cmd := exec.CommandContext(ctx, tmux, append([]string{"-L", socket}, a...)...)
		cmd.Env = append(os.Environ(),
			"PATH="+filepath.Dir(plugin)+string(os.PathListSeparator)+os.Getenv("PATH"),
			"KUBECONFIG="+filepath.Join(e.runDir, "pki", "admin.kubeconfig"))
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	const done = "TOP-EXITED-"
	// The pane outlives the command (sleep) so it can be read; kill-server ends both.
	shell := fmt.Sprintf("%s tessera %s; echo %s$?; sleep 60", kubectl, strings.Join(args, " "), done)
	if out, err := run(ctxFor(t, 10*time.Second), "new-session", "-d", "-x", fmt.Sprint(cols), "-y", "50", "-s", "top", shell); err != nil {
		t.Fatalf("tmux new-session: %v\n%s", err, out)
	}
	t.Cleanup(func() { _, _ = run(context.Background(), "kill-server") })
	var screen string
	waitFor(t, "kubectl tessera top to finish in the terminal", time.Minute, func(ctx context.Context) (bool, string) {
		out, err := run(ctx, "capture-pane", "-p", "-J", "-S", "-", "-t", "top")
		if err != nil {
			return false, err.Error() + ": " + out
		}
		screen = out
		return strings.Contains(out, done), out
	})
	if !strings.Contains(screen, done+"0") {
		t.Fatalf("kubectl tessera %s did not exit 0:\n%s", strings.Join(args, " "), screen)
	}
	return screen
}

func TestRealNodeTopDrawsWholeMigAndShareClaimsInAnEightyColumnTerminal(t *testing.T) {
	rn := realNode(t)
	installChart(t, rn)
	waitChartPods(t, "plugin and MPS supervisor pods Ready on "+rn.name, "kubelet-plugin", "mps-supervisor")

	ns := namespace(t, "real-node-top")
	claimTemplate(t, ns, "whole", gpuClass(t))
	claimTemplate(t, ns, "mig", mig3gClass(t))
	claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "10Gi", "compute": "25"}))
	names := []string{"whole", "mig", "share"}
	for _, name := range names {
		workloadPod(ns, name, rn.name).withClaimFrom(name).create(t)
	}
	for _, name := range names {
		waitRunning(t, ns, name, 3*time.Minute)
	}

	screen := inTerminal(t, 80, "top", "--node", rn.name)
	t.Logf("kubectl tessera top --node %s, as the terminal shows it:\n%s", rn.name, screen)
	for _, line := range strings.Split(screen, "\n") {
		if n := utf8.RuneCountInString(strings.TrimRight(line, " ")); n > 80 {
			t.Errorf("a line of %d columns in an 80-column terminal: %q", n, line)
		}
	}
	want := map[string]*regexp.Regexp{
		"the node as a header":              regexp.MustCompile(`(?m)^== node ` + regexp.QuoteMeta(rn.name) + ` `),
		"the whole GPU held by its pod":     regexp.MustCompile(`(?m)^  whole GPU  ` + regexp.QuoteMeta(ns+"/whole") + ` `),
		"the MIG slice bar":                 regexp.MustCompile(`(?m)^  MIG (\[[A-Z.|]+\]  \d+ of \d+ slices free|static \[[A-Z.|]+\]  \d+ of \d+ held) *$`),
		"the MIG instance's profile, pod":   regexp.MustCompile(`(?m)^    [A-Z] 3g\.\S+ +slices? [\d-]+ +` + regexp.QuoteMeta(ns+"/mig") + ` `),
		"the share's memory, request, ceil": regexp.MustCompile(`(?m)^    ` + regexp.QuoteMeta(ns+"/share") + ` +10Gi +25% +25% `),
		"use read from the plugin's pod":    regexp.MustCompile(`use: from 1 of 1 plugin pods' /metrics`),
	}
	for what, re := range want {
		if !re.MatchString(screen) {
			t.Errorf("%s: no match for %s", what, re)
		}
	}
}
