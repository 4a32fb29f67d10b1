// Command fleet-offline runs the fleet policies on an Azure-format LLM trace without a cluster
// (e2e/k8s/internal/fleetsim) and prints a markdown section; with -svg it also writes the
// utilization–SLO plot. Every parameter is fixed in code (fleetsim.DefaultConfig).
//
//	fleet-offline -trace /work/shared/data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv
//	fleet-offline -trace gen:bursty -svg out.svg
//	fleet-offline -trace gen:low -write-trace low.csv
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"tessera.dev/e2e/internal/fleet"
	"tessera.dev/e2e/internal/fleetsim"
)

func main() {
	trace := flag.String("trace", "", "Azure-format CSV (TIMESTAMP,ContextTokens,GeneratedTokens), or gen:low / gen:bursty")
	svg := flag.String("svg", "", "write the utilization–SLO plot here (SVG)")
	write := flag.String("write-trace", "", "write the (generated) trace here and exit")
	flag.Parse()
	if *trace == "" {
		fmt.Fprintln(os.Stderr, "fleet-offline: -trace is required (a CSV path, gen:low or gen:bursty)")
		os.Exit(2)
	}
	var reqs []fleet.Request
	var err error
	if strings.HasPrefix(*trace, "gen:") {
		reqs, err = fleetsim.Generate(*trace)
	} else {
		reqs, err = fleet.ReadTrace(*trace)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fleet-offline:", err)
		os.Exit(1)
	}
	if *write != "" {
		if err := fleetsim.WriteTrace(*write, reqs); err != nil {
			fmt.Fprintln(os.Stderr, "fleet-offline:", err)
			os.Exit(1)
		}
		return
	}
	cfg := fleetsim.DefaultConfig()
	start := time.Now()
	rows, _ := fleetsim.RunAll(cfg, reqs, append(append([]fleetsim.Policy(nil), fleetsim.Policies...), fleetsim.CurvePolicies...))
	span := time.Duration(0)
	if len(reqs) > 0 {
		span = reqs[len(reqs)-1].At
	}
	name := *trace
	if !strings.HasPrefix(name, "gen:") {
		name = filepath.Base(name)
	}
	fmt.Printf("### Trace %s: %d requests over %s, %d services\n\n", name, len(reqs), span.Round(time.Second), cfg.Services)
	fmt.Print(fleetsim.Table(rows))
	fmt.Printf("\n(%s of wall time on this machine; the last two rows pack burstable shares at half and a quarter of the rule's request: curve points, not the rule.)\n", time.Since(start).Round(time.Second))
	if *svg != "" {
		if err := os.WriteFile(*svg, []byte(fleetsim.SVG("fleet-offline: "+name, rows)), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "fleet-offline:", err)
			os.Exit(1)
		}
	}
}
