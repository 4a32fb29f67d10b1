package iptables

import (
	"context"
	"fmt"
	"os/exec"
	"reflect"
	"strings"
	"testing"
)

// fakeIptables records each call and answers from its script: the first entry whose key prefixes the call's
// arguments gives the output and exit status, through a real process so errors are real *exec.ExitError.
type fakeIptables struct {
	calls   []string
	answers map[string]answer
}

type answer struct {
	out  string
	code int
}

func (f *fakeIptables) run(ctx context.Context, bin string, args ...string) ([]byte, error) {
	call := bin + " " + strings.Join(args, " ")
	f.calls = append(f.calls, call)
	a := answer{}
	for prefix, ans := range f.answers {
		if strings.HasPrefix(call, prefix) {
			a = ans
		}
	}
	return exec.CommandContext(ctx, "sh", "-c", fmt.Sprintf("printf %%s %q; exit %d", a.out, a.code)).CombinedOutput()
}

func newFake(answers map[string]answer) (*client, *fakeIptables) {
	f := &fakeIptables{answers: answers}
	return &client{bin: "iptables", protocol: ProtocolIPv4, run: f.run}, f
}

func TestAMissingRuleIsInsertedAtTheRequestedPositionAfterTheCheck(t *testing.T) {
	c, f := newFake(map[string]answer{"iptables -w 5 -t filter -C": {out: "Bad rule", code: 1}})
	existed, err := c.EnsureRule(context.Background(), Prepend, TableFilter, ChainOutput, "-j", "KUBE-FIREWALL")
	if err != nil || existed {
		t.Fatalf("EnsureRule = %v, %v; want false, nil", existed, err)
	}
	want := []string{
		"iptables -w 5 -t filter -C OUTPUT -j KUBE-FIREWALL",
		"iptables -w 5 -t filter -I OUTPUT -j KUBE-FIREWALL",
	}
	if !reflect.DeepEqual(f.calls, want) {
		t.Errorf("calls %q, want %q", f.calls, want)
	}
}

func TestARuleThatIsThereIsNotAddedTwice(t *testing.T) {
	c, f := newFake(nil)
	existed, err := c.EnsureRule(context.Background(), Append, TableFilter, "KUBE-FIREWALL", "-j", "DROP")
	if err != nil || !existed || len(f.calls) != 1 {
		t.Fatalf("EnsureRule = %v, %v after calls %q; want true, nil after one check", existed, err, f.calls)
	}
}

func TestAFailedCheckIsAnErrorNotAnInsert(t *testing.T) {
	c, f := newFake(map[string]answer{"iptables -w 5 -t filter -C": {out: "can't initialize iptables table", code: 3}})
	if _, err := c.EnsureRule(context.Background(), Append, TableFilter, "KUBE-FIREWALL", "-j", "DROP"); err == nil ||
		!strings.Contains(err.Error(), "can't initialize") {
		t.Fatalf("EnsureRule error %v, want iptables' own message", err)
	}
	if len(f.calls) != 1 {
		t.Errorf("calls %q: a failed check must not be followed by an insert", f.calls)
	}
}

func TestAnExistingChainIsReportedAsExistingForLegacyAndNftWording(t *testing.T) {
	for _, msg := range []string{"iptables: Chain already exists.", "iptables v1.8.9 (nf_tables): Chain 'X' already exists: File exists"} {
		c, _ := newFake(map[string]answer{"iptables -w 5 -t mangle -N": {out: msg, code: 1}})
		existed, err := c.EnsureChain(context.Background(), TableMangle, "KUBE-IPTABLES-HINT")
		if err != nil || !existed {
			t.Errorf("%q: EnsureChain = %v, %v; want true, nil", msg, existed, err)
		}
	}
	c, _ := newFake(map[string]answer{"iptables -w 5 -t mangle -N": {out: "Permission denied (you must be root)", code: 4}})
	if _, err := c.EnsureChain(context.Background(), TableMangle, "KUBE-IPTABLES-HINT"); err == nil {
		t.Error("EnsureChain without permission returned no error")
	}
}
