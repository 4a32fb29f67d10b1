// Package iptables implements the part of sigs.k8s.io/iptables-wrappers/pkg/iptables that Kubernetes 1.38's
// kubelet calls (pkg/kubelet/kubelet_network_linux.go): find the iptables binaries that work, ensure a chain,
// ensure a rule, and watch canary chains so the rules come back after something flushes the tables. It runs
// iptables and ip6tables as the upstream package does; kube-proxy's restore and save paths are not here, since
// nothing built from e2e/k8s uses them.
package iptables

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// Table names an iptables table.
type Table string

// Chain names an iptables chain.
type Chain string

// RulePosition says where EnsureRule puts a missing rule: its iptables flag.
type RulePosition string

// Protocol is the IP family a client manages.
type Protocol string

// Mode says which iptables variant a client runs; the stand-in runs what is installed under the plain names.
type Mode string

const (
	TableNAT    Table = "nat"
	TableFilter Table = "filter"
	TableMangle Table = "mangle"

	ChainInput  Chain = "INPUT"
	ChainOutput Chain = "OUTPUT"

	Prepend RulePosition = "-I"
	Append  RulePosition = "-A"

	ProtocolIPv4 Protocol = "IPv4"
	ProtocolIPv6 Protocol = "IPv6"

	// UseInstalledMode runs `iptables` and `ip6tables` as found on PATH.
	UseInstalledMode Mode = "installed"
)

// Interface is what kubelet holds per IP family.
type Interface interface {
	// EnsureChain creates chain in table unless it exists; it reports whether it existed.
	EnsureChain(ctx context.Context, table Table, chain Chain) (bool, error)
	// EnsureRule adds the rule at position unless chain has it; it reports whether it existed.
	EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain, args ...string) (bool, error)
	// IsIPv6 reports whether the client manages IPv6 rules.
	IsIPv6() bool
	// Protocol is the client's IP family.
	Protocol() Protocol
	// Monitor creates canary in every table, then every interval until ctx ends checks that each is still
	// there; when one is gone (tables flushed) it deletes the rest, calls reload and creates them again.
	Monitor(ctx context.Context, canary Chain, tables []Table, reload func(), interval time.Duration)
}

// runner runs an iptables binary; tests swap it for a recorder.
type runner func(ctx context.Context, bin string, args ...string) ([]byte, error)

func execRunner(ctx context.Context, bin string, args ...string) ([]byte, error) {
	return exec.CommandContext(ctx, bin, args...).CombinedOutput()
}

type client struct {
	bin      string
	protocol Protocol
	run      runner
}

// New returns a client for protocol that runs the installed binary for it.
func New(protocol Protocol) Interface {
	bin := "iptables"
	if protocol == ProtocolIPv6 {
		bin = "ip6tables"
	}
	return &client{bin: bin, protocol: protocol, run: execRunner}
}

// NewBestEffort returns a client for each IP family whose binary lists the filter table; none when iptables
// is missing or unusable (kubelet then skips its rules, as on nftables-only hosts).
func NewBestEffort(ctx context.Context, _ Mode) map[Protocol]Interface {
	clients := map[Protocol]Interface{}
	for _, p := range []Protocol{ProtocolIPv4, ProtocolIPv6} {
		c := New(p).(*client)
		if _, err := c.iptables(ctx, "-t", string(TableFilter), "-S", string(ChainInput)); err == nil {
			clients[p] = c
		}
	}
	return clients
}

func (c *client) IsIPv6() bool       { return c.protocol == ProtocolIPv6 }
func (c *client) Protocol() Protocol { return c.protocol }

// iptables runs the binary, waiting for the xtables lock as kubelet's own calls always have.
func (c *client) iptables(ctx context.Context, args ...string) ([]byte, error) {
	out, err := c.run(ctx, c.bin, append([]string{"-w", "5"}, args...)...)
	if err != nil {
		return out, fmt.Errorf("%s %s: %w: %s", c.bin, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return out, nil
}

// exitCode is the status of a binary that ran and failed; -1 when it did not run.
func exitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

func (c *client) EnsureChain(ctx context.Context, table Table, chain Chain) (bool, error) {
	out, err := c.iptables(ctx, "-t", string(table), "-N", string(chain))
	if err == nil {
		return false, nil
	}
	// iptables exits 1 and says the chain exists (legacy: "Chain already exists", nft: "File exists").
	if exitCode(err) == 1 && (strings.Contains(string(out), "exists")) {
		return true, nil
	}
	return false, err
}

func (c *client) EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain, args ...string) (bool, error) {
	rule := append([]string{string(chain)}, args...)
	_, err := c.iptables(ctx, append([]string{"-t", string(table), "-C"}, rule...)...)
	if err == nil {
		return true, nil
	}
	// -C exits 1 for a rule that is not there; anything else is a failure to check.
	if exitCode(err) != 1 {
		return false, err
	}
	if _, err := c.iptables(ctx, append([]string{"-t", string(table), string(position)}, rule...)...); err != nil {
		return false, err
	}
	return false, nil
}

func (c *client) chainExists(ctx context.Context, table Table, chain Chain) bool {
	_, err := c.iptables(ctx, "-t", string(table), "-n", "-L", string(chain))
	return err == nil
}

func (c *client) Monitor(ctx context.Context, canary Chain, tables []Table, reload func(), interval time.Duration) {
	create := func() bool {
		for _, t := range tables {
			if _, err := c.EnsureChain(ctx, t, canary); err != nil {
				return false
			}
		}
		return true
	}
	for !create() {
		select {
		case <-ctx.Done():
			return
		case <-time.After(interval):
		}
	}
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
		gone := false
		for _, t := range tables {
			if !c.chainExists(ctx, t, canary) {
				gone = true
				break
			}
		}
		if !gone {
			continue
		}
		// Delete what is left so every table starts again from the same state, then rebuild.
		for _, t := range tables {
			_, _ = c.iptables(ctx, "-t", string(t), "-X", string(canary))
		}
		reload()
		create()
	}
}
